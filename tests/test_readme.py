"""README.md and docs/ stay true: every code block runs as written, and the lists they give match the code.

Convention: every ```python block is executed on CPU in a fresh interpreter as a reader runs it after
``pip install``: cwd a temporary folder, and on the path only the packages the wheel ships (linked from
this checkout), so a block that imports the repo's ``bench`` or ``tests`` fails. A block that needs
objects the reader already has (a model, a dataset, trainer arguments) is preceded by ``<!-- prelude: NAME -->``: the test runs
``PRELUDES[NAME]`` first (a tiny random model, CPU arguments, no download), then the block as
written, then ``EPILOGUES[NAME]``, which checks the block did what it says. A block that cannot run
on a CPU in a few seconds starts with ``# not run: <reason>`` and is only compiled. ```yaml blocks
are parsed (an ``activation_offload`` section through ``offload.integrations.torchtitan``); ```bash
blocks are not run (the set-up commands are checked against .ci/run instead).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import offload
from _installed import linked_install, wheel_packages

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
NOT_RUN = re.compile(r"#\s*not run:\s*(\S.*)")
PRELUDE = re.compile(r"<!--\s*prelude:\s*(\w+)\s*-->")

_TINY_LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
"""

_TINY_LM = """
import torch
from torch import nn
torch.manual_seed(0)

class TinyLM(nn.Module):  # the reader's model: embedding, residual blocks, output head
    def __init__(self, vocab=128, dim=32, n_layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                    for _ in range(n_layers))
        self.output = nn.Linear(dim, vocab, bias=False)
    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.output(h)

def make_batch(n, seq, vocab=128):
    t = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(1))
    return t[:, :-1], t[:, 1:]
"""

PRELUDES = {
    "hf": _TINY_LLAMA + """
import tempfile
from transformers import Trainer, TrainingArguments
ds = [{"input_ids": r, "labels": r} for r in ids]
args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                         report_to="none", save_strategy="no", disable_tqdm=True)
""",
    "trl": _TINY_LLAMA + """
import tempfile
import datasets
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer
tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)},
                              unk_token="t1")), pad_token="t0", eos_token="t2", unk_token="t1")
ds = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
args = SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                 report_to="none", save_strategy="no", disable_tqdm=True, max_length=16)
""",
    "lightning": _TINY_LM + """
import lightning
import torch.nn.functional as F

class Module(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = TinyLM()
    def training_step(self, batch, i):
        tokens, targets = batch
        return F.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

module = Module()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*make_batch(4, 16)), batch_size=2)
""",
    "plan": _TINY_LM + """
import torch.nn.functional as F
model = TinyLM()
tokens, targets = make_batch(2, 16)
step = lambda: F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())  # one forward: the loss
""",
    "loop": """
import torch
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
x, y, loss_fn = torch.randn(8, 64), torch.randn(8, 1), torch.nn.functional.mse_loss
""",
    "torchtitan": _TINY_LM + """
import yaml
model = TinyLM()
job_config = yaml.safe_load(PREVIOUS_YAML)   # the yaml block just above this one on the page
""",
}

EPILOGUES = {
    # The callbacks ran and their engines recorded every step (pass-through on a machine without a GPU).
    "hf": """
(cb,) = [c for c in trainer.callback_handler.callbacks if type(c).__name__ == "OffloadCallback"]
assert len(cb.engine.ledger.step_totals) == 2, cb.engine.ledger.step_totals
""",
    "lightning": """
(cb,) = [c for c in trainer.callbacks if type(c).__name__ == "OffloadCallback"]
assert len(cb.engine.ledger.step_totals) == 2, cb.engine.ledger.step_totals
""",
    "plan": """
assert plan.target.name == "h100-sxm" and plan.cost.optimizer.given and plan.cost.optimizer.name == "AdamW"
assert plan.report().splitlines()[0].startswith("optimizer AdamW included")
""",
    "loop": """
assert len(ctx.ledger.step_totals) == 1 and ctx.ledger.summary()["packed_count"] > 0
""",
    "torchtitan": """
assert ctx.config.host_budget_bytes == 16 << 30
tokens, targets = make_batch(2, 16)
with ctx:
    logits = model(tokens)
logits.sum().backward()
assert len(ctx.ledger.step_totals) == 1
""",
}
EPILOGUES["trl"] = EPILOGUES["hf"] + "assert not args.activation_offloading\n"
PRELUDES["trl_flag"] = PRELUDES["trl"] + "args.activation_offloading = True\n"
EPILOGUES["trl_flag"] = """
from offload import OffloadActivations
assert isinstance(trainer.maybe_activation_offload_context, OffloadActivations)
assert patch.engines == [trainer.maybe_activation_offload_context]
assert len(patch.engines[0].ledger.step_totals) == 2
"""


def _blocks(page: Path) -> list[tuple[int, str, str, str | None, str]]:
    """(first line, language, code, prelude name, previous yaml block) of every fenced block."""
    out, lines = [], page.read_text().splitlines()
    prev_yaml, i = "", 0
    while i < len(lines):
        m = re.fullmatch(r"\s*```(\w+)\s*", lines[i])
        if m:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            prelude = PRELUDE.fullmatch(before.strip())
            start, body = i + 2, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            code = "\n".join(body) + "\n"
            out.append((start, m.group(1), code, prelude.group(1) if prelude else None, prev_yaml))
            if m.group(1) == "yaml":
                prev_yaml = code
        i += 1
    return out


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


ALL = [(f"{_name(p)}:{n}", lang, code, pre, prev) for p in PAGES for n, lang, code, pre, prev in _blocks(p)]
# A snippet shown on two pages (the README's and its docs page) runs once, under its first place.
_seen: set[tuple[str, str | None]] = set()
PYTHON = [b for b in ALL if b[1] == "python" and not ((b[2], b[3]) in _seen or _seen.add((b[2], b[3])))]
YAML = [b for b in ALL if b[1] == "yaml"]


def test_pages_have_python_blocks():
    assert len([b for b in PYTHON if b[0].startswith("README.md")]) >= 5
    assert len(PYTHON) >= 15


def _imports(code: str) -> set[str]:
    import ast

    tree = ast.parse(code)
    return ({a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            | {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module})


@pytest.mark.parametrize("where,lang,code,prelude,prev_yaml", PYTHON, ids=[b[0] for b in PYTHON])
def test_python_block_needs_only_the_installed_package(where, lang, code, prelude, prev_yaml):
    """A block (and its prelude) imports nothing from the checkout that ``pip install`` does not ship:
    no ``bench``, no ``tests`` (a reader outside the clone has neither)."""
    checkout_only = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()} - {
        p.split(".")[0] for p in wheel_packages()}
    used = _imports(code) | (_imports(PRELUDES[prelude]) if prelude in PRELUDES else set())
    assert not used & checkout_only, f"{where} imports {sorted(used & checkout_only)}, which pip install lacks"


@pytest.mark.parametrize("where,lang,code,prelude,prev_yaml", PYTHON, ids=[b[0] for b in PYTHON])
def test_python_block_runs(where, lang, code, prelude, prev_yaml, tmp_path):
    """The block runs as written on CPU, after its prelude (or, marked ``# not run: <reason>``, compiles)."""
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    compile(code, where, "exec")  # every block must at least be valid Python
    if NOT_RUN.match(first):
        return
    script = code
    if prelude is not None:
        assert prelude in PRELUDES, f"{where}: no prelude named {prelude!r} in tests/test_readme.py"
        for module in {"hf": "transformers", "trl": "trl", "trl_flag": "trl", "lightning": "lightning"}.get(
                prelude, "").split():
            pytest.importorskip(module)
        script = (f"PREVIOUS_YAML = {prev_yaml!r}\n" + PRELUDES[prelude] + "\n" + code + "\n"
                  + EPILOGUES.get(prelude, ""))
    env = dict(os.environ, PYTHONPATH=str(linked_install(tmp_path)), CUDA_VISIBLE_DEVICES="",
               PYTHONWARNINGS="default")
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (
        f"{where}: block failed (mark it '# not run: <reason>' only if it cannot run on a CPU in seconds):\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("where,lang,code,prelude,prev_yaml", YAML, ids=[b[0] for b in YAML])
def test_yaml_block_loads(where, lang, code, prelude, prev_yaml):
    """A yaml block parses; an activation_offload section is one offload.integrations.torchtitan accepts."""
    data = yaml.safe_load(code)
    if isinstance(data, dict) and "activation_offload" in data:
        from offload.integrations.torchtitan import config_from_section

        config_from_section(data["activation_offload"])


def test_not_run_blocks_give_a_reason():
    """A skipped block says why (``# not run:`` followed by text)."""
    for where, _, code, _, _ in PYTHON:
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        if first.lstrip().startswith("# not run"):
            assert NOT_RUN.match(first), f"{where}: '# not run:' needs a reason"


def test_readme_snippets_are_short():
    """The README's trainer snippets stay at most 5 lines each (the depth lives in docs/)."""
    for where, _, code, prelude, _ in PYTHON:
        if where.startswith("README.md"):
            assert prelude is not None and len(code.strip().splitlines()) <= 5, where


def _bash_commands(page: Path) -> list[str]:
    return [line.strip() for _, lang, code, _, _ in _blocks(page) if lang == "bash" for line in code.splitlines()]


MAIN_JOB = 'pip install torch==2.13.0 && pip install -e ".[bench]" && python -m bench'
"""The main job from a fresh clone: the pinned torch first, then the bench extra only (not the test extra's
~110 packages)."""


def test_set_up_commands_match_ci():
    """The README's test command is the one .ci/run runs; both set-up commands install from a fresh clone
    (the pinned torch first, then the bench extra for the main job, the test extra for the tests), and
    getting-started gives the same two."""
    commands = _bash_commands(README)
    setup = [c for c in commands if c.startswith("pip install torch==2.13.0 && pip install -e ") and c.count(" && ") > 1]
    assert len(setup) == 2 and setup[0] == MAIN_JOB, setup
    assert setup[1].startswith('pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -m "not slow"')
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup[1] in ci.splitlines(), "README's test command and .ci/run differ"
    assert set(setup) <= set(_bash_commands(DOCS / "getting-started.md")), "getting-started's commands differ"
    assert setup[0] in ci.splitlines(), "CI does not run the README's main-job command as written"


def test_set_up_starts_in_a_venv_that_git_ignores_and_runs_the_venvs_pytest():
    """The README's first command makes and activates a venv (.venv, which git ignores); no page's set-up
    runs a bare ``pytest`` (in a ``--system-site-packages`` venv that can be the system's): ``python -m pytest``
    (issue 45 item 7)."""
    first = _bash_commands(README)[0]
    assert first.startswith("python -m venv .venv && source .venv/bin/activate"), first
    if shutil.which("git") is not None and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", ".venv/bin/python"], cwd=ROOT)
        assert ignored.returncode == 0, ".venv is not git-ignored"
    for page in (README, DOCS / "getting-started.md", ROOT / ".ci" / "run"):
        lines = _bash_commands(page) if page.suffix == ".md" else page.read_text().splitlines()
        bare = [c for c in lines if re.search(r"(^|&&\s*)pytest\b", c.strip())]
        assert not bare, (page.name, bare)


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([a-z_]+)`", text)


def test_docs_list_exactly_the_reasons():
    """The API page's REASONS row and the ledger page's list give every reason in offload.REASONS, in order."""
    row = next(line for line in (DOCS / "api.md").read_text().splitlines() if line.startswith("| `REASONS` |"))
    assert tuple(_backticked(row.split("|")[2])) == offload.REASONS
    listed = re.findall(r"^  - `([a-z_]+)`:", (DOCS / "ledger.md").read_text(), flags=re.M)
    assert tuple(listed) == offload.REASONS


def test_pages_cite_results_files_that_exist():
    """Every bench/results/... file the README or the docs cite is in the repo; the README cites one."""
    cited = {}
    for page in PAGES:
        for p in re.findall(r"`(bench/results/[\w./-]+\.(?:json|md|png))`", page.read_text()):
            cited.setdefault(p, _name(page))
    assert any(page == "README.md" for page in cited.values()), "the README cites no results file"
    missing = sorted(f"{p} (cited in {page})" for p, page in cited.items() if not (ROOT / p).is_file())
    assert not missing, missing


# -- the README's figures are the files' (issue 45 item 6) ------------------------------------------------


def _results(path: str) -> dict:
    import json

    return json.loads((ROOT / path).read_text())


def _flat(text: str) -> str:
    """Whitespace folded to single spaces (a claim may wrap across lines)."""
    return re.sub(r"\s+", " ", text)


def _results_table(path: str) -> list[str]:
    """The README's results table rows, as its file gives them: CPU time x none with its 95% interval,
    activation MiB, gradients."""
    d = _results(path)
    rows = []
    for name in ("none", "ac", "offload", "offload_ac", "save_on_cpu", "account_only"):
        s = next(x for x in d["strategies"] if x["name"] == name)
        r = d["ratios"][name]
        lo, hi = r["cpu_time_x_none_ci95"]
        t = "1.000" if name == "none" else f"{r['cpu_time_x_none']:.3f} [{lo:.3f}-{hi:.3f}]"
        grads = "reference" if name == "none" else ("bitwise equal" if s["correctness"]["bitwise_equal"] else "NOT")
        rows.append(f" | {t} | {s['activation_bytes'] / 2**20:.1f} | {grads} |")
    return rows


def _planner_files(cited: str) -> list[str]:
    """The planner met every budget it accepted, measured, in each of the four models' files."""
    files = sorted(ROOT.glob("bench/results/cpu/plan_*_L4_s256_b2_float32.json"))
    files = [f for f in files if "maxseq" not in f.name]
    for f in files:
        for row in _results(str(f.relative_to(ROOT)))["planned"]:
            if row["status"] == "ok":
                assert row["measured_peak_bytes"] <= row["budget_bytes"], (f.name, row["fraction"])
    assert len(files) == 4
    return ["met every budget it accepted, measured, at 25 / 50 / 75 % of activation memory on four models"]


def _h200_8b(path: str) -> list[str]:
    """The clean H200 run's figures (no GPU-trace callback registered at any strategy's start or end)."""
    from bench.strategies import part_blocks

    d = _results(path)
    assert d["meta"]["gpu_trace_at_start"]["callbacks"] == 0 == d["meta"]["gpu_trace_at_end"]["callbacks"]
    r = d["ratios"]
    by = {s["name"]: s for s in d["strategies"]}
    assert all(s["correctness"]["bitwise_equal"] for s in by.values() if s["status"] == "ok")
    off, part, ceil = by["offload"]["engine"], by["offload_part"], d["ceiling"]
    rate = min(off["d2h_gb_s"] / ceil["d2h_gb_s"], off["h2d_gb_s"] / ceil["h2d_gb_s"])
    link_s = off["d2h_bytes"] / (ceil["d2h_gb_s"] * 1e9) + off["h2d_bytes"] / (ceil["h2d_gb_s"] * 1e9)
    cut = (by["none"]["activation_bytes"] - part["activation_bytes"]) / part["engine"]["offloaded_bytes"]
    n = d["meta"]["fit_layers"]["fits"]
    return [f"the engine idle at {r['account_only']['time_x_none']:.3f}x `none`",
            f"the first {part_blocks(n)} of {n} blocks offloaded at "
            f"{r['offload_part']['time_x_none']:.3f}x `none`, the activation peak down by {100 * cut:.0f} % of the "
            "bytes copied",
            f"`offload` at {r['offload']['time_x_none']:.2f}x `none` ({off['offloaded_bytes'] / 1e9:.1f} GB a step), "
            f"{by['offload']['median_s'] / link_s:.2f}x the link-bound time",
            f"`offload_ac` {100 * (1 - r['offload_ac']['activation_x_ac']):.0f} % less activation memory than `ac` at "
            f"{r['offload_ac']['time_x_ac']:.3f}x its step", f"copies at {100 * rate:.0f} % of pinned bandwidth"]


def _gpu_tests(path: str) -> list[str]:
    """Passed of run, over the run's two clean test phases (``errors`` and ``tests``)."""
    passed = failed = 0
    for name in ("gpu_tests.txt", "errors.txt"):
        last = (ROOT / path).with_name(name).read_text().strip().splitlines()[-1]
        got = {w: int(m.group(1)) if (m := re.search(rf"(\d+) {w}", last)) else 0 for w in ("failed", "passed")}
        passed, failed = passed + got["passed"], failed + got["failed"]
    return [f"{passed} of {passed + failed} GPU tests passed"]


def _h200_plan(path: str) -> list[str]:
    """Every budget met, measured, at the predicted peak (within 0.5 %), faster than ``ac`` measured beside it."""
    d = _results(path)
    ac = next(a for a in d["arms"] if a["name"] == "ac")
    rows = d["planned"]
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert r["measured_peak_bytes"] <= r["budget_bytes"] and abs(r["peak_error"]) < 0.005, r["fraction"]
        assert r["measured_step_s"] < ac["step_s"], r["fraction"]
    return ["met both budgets with the peak it predicted, faster than `ac`"]


_PVM_STRATEGIES = ("none", "ac", "offload_ac", "offload_part", "offload")


def _predicted_vs_measured(path: str) -> list[str]:
    """Predicted over measured for none, ac, offload_ac, offload_part and offload: peak and step at 8B width."""
    out = {}
    for f in _results(path)["files"]:
        ratios = [f["strategies"][n]["ratio"] for n in _PVM_STRATEGIES if n in f["strategies"]]
        out[f["measured_file"].split("_")[0] + "_" + f["measured_file"].split("_")[2]] = {
            k: (min(x[k] for x in ratios), max(x[k] for x in ratios)) for k in ("peak_allocated_bytes", "step_seconds")}
    big = out["8b_s4096"]
    return [f"peaks {big['peak_allocated_bytes'][0]:.2f}-{big['peak_allocated_bytes'][1]:.2f}x of measured, steps "
            f"{big['step_seconds'][0]:.2f}-{big['step_seconds'][1]:.2f}x"]


def _predicted_8b(path: str) -> list[str]:
    rows = {r["strategy"]: r for r in _results(path)["rows"]}
    gib = {n: f"{r['peak_bytes'] / 2**30:.1f} GiB" for n, r in rows.items()}
    assert not rows["none"]["fits"] and rows["ac"]["fits"] and rows["offload_ac"]["fits"]
    return [f"no checkpointing {gib['none']} (does not fit), `ac` {gib['ac']}, `offload_ac` {gib['offload_ac']} at "
            f"{rows['offload_ac']['step_vs_ac']:.2f}x the step of `ac`"]


def _tiers(path: str) -> list[str]:
    t = _results(path)["target"]
    assert t["met"] and t["what"] == "disk@50 step time <= 1.25x host_only"
    return [f"tier cost {t['ratio']:.2f}x the step of an unbounded pool (target 1.25x, met"]


def _max_context(path: str) -> list[str]:
    rows = {r["strategy"]: r for r in _results(path)["rows"] if (r["workload"], r["card"]) == ("lora", "h100-sxm")}
    lc = rows["long_context"]
    return [f"Llama-3.1-8B LoRA r=16 on `h100-sxm`: {lc['max_context']:,} tokens, {lc['host_bytes'] / 2**30:.0f} GiB "
            f"pinned host memory (`ac`: {rows['ac']['max_context']:,}"]


def _max_seq(path: str) -> list[str]:
    rows = {r["arm"]: r["max_seq"] for r in _results(path)["rows"]}
    return [f"{rows['long_context'] / rows['ac']:.0f}x `ac`'s sequence"]


README_CLAIMS = {
    "bench/results/cpu/tiny_L4_s256_b2_float32.json": _results_table,
    "bench/results/cpu/plan_hf_llama_L4_s256_b2_float32.md": _planner_files,
    "bench/results/nvidia-h200/2026-11-29-4358372/8b_L32_s4096_b1_bfloat16.md": lambda p: _h200_8b(p.replace(".md", ".json")),
    "bench/results/nvidia-h200/2026-11-29-4358372/gpu_tests.txt": _gpu_tests,
    "bench/results/nvidia-h200/2026-11-29-c38e47a/plan_8b_L32_s4096_b1_bfloat16.md": lambda p: _h200_plan(p.replace(".md", ".json")),
    "bench/results/nvidia-h200/2026-11-29-4358372/predicted_vs_measured.md": lambda p: _predicted_vs_measured(p.replace(".md", ".json")),
    "bench/results/predicted/predict_llama3-8b_h100-sxm_s8192.md": lambda p: _predicted_8b(p.replace(".md", ".json")),
    "bench/results/cpu/tiers_tiny_L4_s256_b2_float32.json": _tiers,
    "bench/results/predicted/max_context_llama3.1-8b.md": lambda p: _max_context(p.replace(".md", ".json")),
    "bench/results/cpu/plan_maxseq_hf_llama_L4_s256_b1_float32.md": lambda p: _max_seq(p.replace(".md", ".json")),
}
"""Each results file the README cites -> its figures as the README must write them, computed from the file."""


def _benchmarks_table(path: str) -> list[str]:
    """docs/benchmarks.md's CPU table: wall and CPU ms, CPU time x none with its interval, activation MiB and x
    none, host copies MiB, per strategy."""
    import statistics

    d = _results(path)
    out = []
    for s in d["strategies"]:
        if s["status"] != "ok":
            continue
        r = d["ratios"][s["name"]]
        lo, hi = r["cpu_time_x_none_ci95"]
        t = "1.000" if s["name"] == "none" else f"{r['cpu_time_x_none']:.3f} [{lo:.3f}-{hi:.3f}]"
        out.append(f"| {s['name']} | {s['median_s'] * 1e3:.1f} | {statistics.median(s['times']['cpu_seconds']) * 1e3:.1f} "
                   f"| {t} | {s['activation_bytes'] / 2**20:.1f} | {r['activation_x_none']:.3f} | "
                   f"{s['host_copy_bytes'] / 2**20:.1f} |")
    return out


def _planner_row(path: str) -> list[str]:
    """docs/planner.md's table: per budget, peak and step predicted -> measured and the verdict against the
    fastest fixed strategy that fits."""
    out = []
    for r in _results(path)["planned"]:
        if r["status"] == "ok":
            out.append(f"{r['predicted_peak_bytes'] / 2**20:.1f} → {r['measured_peak_bytes'] / 2**20:.1f} MiB, "
                       f"{r['predicted_step_s'] * 1e3:.0f} → {r['measured_step_s'] * 1e3:.0f} ms, "
                       f"{r['vs_fastest_fixed']} vs {r['fastest_fixed']}")
        else:
            out.append("| no plan")
    return out


def _copied_table(path: str) -> list[str]:
    """A page that shows a results file's table shows its rows as the file has them."""
    lines = (ROOT / path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    return [line for line in lines[start:] if line.startswith("| ")][:12]


def _per_rank_table(path: str) -> list[str]:
    """The per-rank table: bf16 state (``path``) and mixed precision (its ``_mpbf16`` twin) side by side."""
    mixed = {r["strategy"]: r for r in _results(path.replace(".json", "_mpbf16.json"))["rows"]}
    return [f"| {r['strategy']} | {r['peak_bytes'] / 2**30:.2f} | {mixed[r['strategy']]['peak_bytes'] / 2**30:.2f} | "
            f"{r['offloaded_bytes'] / 2**30:.2f} | {r['step_seconds']:.3f} / {mixed[r['strategy']]['step_seconds']:.3f} |"
            for r in _results(path)["rows"]]


_PLAN_FILES = [f"bench/results/cpu/plan_{m}_L4_s256_b2_float32.json" for m in ("tiny", "encoder", "hf_llama", "hf_gpt2")]
DOC_CLAIMS = {
    "docs/benchmarks.md": {"bench/results/cpu/tiny_L4_s256_b2_float32.json": _benchmarks_table},
    "docs/planner.md": dict.fromkeys(_PLAN_FILES, _planner_row),
    "docs/predict.md": {"bench/results/predicted/predict_llama3-8b_h100-sxm_s8192.md": _copied_table,
                        "bench/results/predicted/predict_llama3-8b_h100-sxm_s8192_x8.md":
                            lambda p: _per_rank_table(p.replace(".md", ".json")),
                        "bench/results/predicted/predict_llama3-8b_h100-sxm_s8192_x8_mpbf16.md": lambda p: []},
}
"""Pages of docs/ whose figures are checked against the files they cite (the tables)."""


@pytest.mark.parametrize("page", sorted(DOC_CLAIMS))
def test_docs_tables_are_the_files_they_cite(page):
    """A docs table that cites a results file gives the figures the file holds."""
    text = (ROOT / page).read_text()
    flat = _flat(text)
    for path, claims in DOC_CLAIMS[page].items():
        assert f"`{path}`" in text, f"{page} no longer cites {path}"
        for claim in claims(path):
            assert claim in flat, f"{page} does not say what {path} shows: expected {claim!r}"


def test_readme_figures_are_the_files_they_cite():
    """Every results file the README cites has its figures checked here, and each figure the README gives is
    the one its file holds (a number that disagrees with its file fails, naming both)."""
    text = README.read_text()
    cited = set(re.findall(r"`(bench/results/[\w./-]+\.(?:json|md|png|txt))`", text))
    assert cited == set(README_CLAIMS), (sorted(cited - set(README_CLAIMS)), sorted(set(README_CLAIMS) - cited))
    flat = _flat(text)
    for path, claims in README_CLAIMS.items():
        for claim in claims(path):
            assert claim in flat, f"README.md does not say what {path} shows: expected {claim!r}"


def _first_screen() -> str:
    text = README.read_text()
    return text[:text.index("\n## ")]


def test_first_screen_says_what_the_snippets_do_without_a_gpu(monkeypatch):
    """The README's first screen says its trainer snippets run pass-through without a GPU and names
    device="cpu" for the real path, after the trainer snippets; and both claims hold on this machine."""
    import warnings

    import torch

    screen = _first_screen()
    said = screen.find("pass-through")
    assert said > screen.find("OffloadCallback()") >= 0, "the first screen does not say what happens without a GPU"
    assert 'device="cpu"' in screen[said:said + 400], screen[said:said + 400]
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # as on a machine without a GPU
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    for device, moved in ((None, False), ("cpu", True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx = offload.OffloadActivations(device=device)
            with ctx:
                loss = model(torch.randn(8, 64)).sum()
            loss.backward()
        s = ctx.ledger.summary()
        assert (s["offloaded_bytes"] > 0) == moved and s["packed_count"] > 0, (device, s)
        assert len([w for w in caught if "pass-through" in str(w.message)]) == (0 if moved else 1), (
            device, [str(w.message) for w in caught])
