"""The results files the README and docs cite stay true to the code: each is re-run (the command its
meta records, at one warm-up and one measured step) and every deterministic figure in it (bytes, counts,
losses, gradient verdicts, statuses) must equal the fresh run's. On CPU these do not depend on the machine's
load or on the number of steps; times, rates and the machine's own figures (RSS, disk and copy speeds) do,
and are left out. A change that moves a figure must regenerate the file with the command in its meta."""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "bench/results/cpu/"

TIMING = re.compile(r"(^|_)(s|seconds|gb_s|per_s|tflops|times|step_s_all|median|iqr|vs_host_only)$")
"""Keys of times and rates (and of figures made from them): the machine's, not the code's."""
PER_RUN = {"steps", "warmup", "rss_bytes", "peak_pending_bytes", "bytes_by_step", "meta", "ceiling", "targets",
           "ratios", "disk_probe", "target", "method"}
"""Keys left out as a whole: the run's settings and environment, the process's RSS, a disk queue's depth at
the moment a copy was issued, one entry per step run, and the sections made of times (the copy ceiling,
targets, ratios, the disk probe)."""
RUN_TOTALS = re.compile(r"rows\[[^]]+\]\.(d2h_bytes|disk\.written_bytes|disk\.read_bytes)")
"""The host-tier bench's totals over all of a run's steps (its per-step figures are compared)."""

CHECKED = {
    "tiny_L4_s256_b2_float32.json": False,  # the README's results table
    "verify/tiny_L4_s256_b2_float32.json": False,  # docs/emulator.md: verify=True's cost
    "tiers_tiny_L4_s256_b2_float32.json": True,  # README and docs/host-tiers.md: the host tiers
}
"""Each cited results file checked here, and whether its re-run is slow (> ~20 s on 2 cores)."""
NOT_CHECKED = {
    "hook_cost.json": "instruction counts under callgrind (minutes; agree to ~1% between runs, not exactly)",
    "pool_replay.json": "times of the host pool's replay",
    "profiler_overhead.json": "step times of the profilers",
    "maxseq_host_tiny_L4_s128_b2_float32.json": "a search over sequence lengths (minutes)",
    "plan_maxseq_tiny_L4_s256_b2_float32.json": "a search over sequence lengths per arm (minutes)",
}
"""Cited results files not re-run here, each with the reason. The planner's files
(``plan_<model>_*.json``: several minutes each, torch's ILP included) are matched by PLAN below."""
PLAN = re.compile(r"plan_(toy|tiny|encoder|hf_llama|hf_gpt2)_L\d+_s\d+_b\d+_\w+\.json")
GPU = re.compile(r"bench/results/(nvidia|amd)-[\w-]+/[\w./-]+\.json")
"""Files measured on a GPU (``scripts/gpu_run.sh``): this CPU cannot re-run them."""


def figures(doc, path: str = "") -> dict[str, object]:
    """The deterministic leaves of a results document, by path (lists of named rows by their name)."""
    out: dict[str, object] = {}
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key not in PER_RUN and not TIMING.search(key):
                out.update(figures(value, f"{path}.{key}" if path else key))
    elif isinstance(doc, list) and doc and all(isinstance(r, dict) and ("name" in r or "arm" in r) for r in doc):
        for row in doc:
            out.update(figures(row, f"{path}[{row.get('name', row.get('arm'))}]"))
    elif RUN_TOTALS.fullmatch(path):
        pass
    elif isinstance(doc, (bool, int, float)) or doc is None or (isinstance(doc, str) and path.endswith("status")):
        out[path] = doc
    return out


def rerun_argv(command: str, out: Path) -> list[str]:
    """The recorded command at one warm-up and one measured step, writing into ``out`` only."""
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "bench"], command
    argv, rest = [], iter(words[3:])
    for w in rest:
        if w in ("--out", "--steps", "--warmup"):
            next(rest)
        elif w not in ("--quiet", "--no-plot", "--no-probe"):
            argv.append(w)
    return [sys.executable, "-m", "bench", *argv, "--steps", "1", "--warmup", "1", "--no-probe", "--no-plot",
            "--quiet", "--out", str(out)]


def _cited() -> set[str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return {p.removeprefix(RESULTS) for page in pages
            for p in re.findall(r"`(bench/results/[\w./-]+\.json)`", page.read_text())}


def test_every_cited_results_file_is_checked_or_says_why_not():
    """Each bench/results JSON the README or docs cite is re-run here, or is listed with the reason it is
    not; the README's results table is among the checked."""
    cited = _cited()
    assert "tiny_L4_s256_b2_float32.json" in cited
    unclassified = sorted(c for c in cited if c not in CHECKED and c not in NOT_CHECKED and not PLAN.fullmatch(c)
                          and not GPU.fullmatch(c))
    assert not unclassified, f"cited results files neither checked nor excused: {unclassified}"
    assert set(CHECKED) <= cited, sorted(set(CHECKED) - cited)


def test_figures_keep_bytes_and_verdicts_and_drop_times():
    """The comparison sees a changed byte count, count or gradient verdict, and ignores times, rates, RSS
    and the run's settings (so it cannot pass by comparing nothing, nor fail on a slower machine)."""
    doc = {"meta": {"steps": 20}, "strategies": [
        {"name": "offload", "status": "ok", "activation_bytes": 1, "rss_bytes": 5, "median_s": 0.1,
         "times": {"seconds": [0.1]}, "engine": {"steps": 20, "offloaded_bytes": 2, "d2h_gb_s": 9.0,
                                                 "pool_allocations_total": 3},
         "correctness": {"bitwise_equal": True, "grads_compared": 31}}]}
    assert figures(doc) == {"strategies[offload].status": "ok", "strategies[offload].activation_bytes": 1,
                            "strategies[offload].engine.offloaded_bytes": 2,
                            "strategies[offload].engine.pool_allocations_total": 3,
                            "strategies[offload].correctness.bitwise_equal": True,
                            "strategies[offload].correctness.grads_compared": 31}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if slow else [])
                                  for n, slow in CHECKED.items()])
def test_committed_figures_equal_a_fresh_run(name, tmp_path):
    """Every deterministic figure of the committed file equals a fresh run of the command it records."""
    committed = json.loads((ROOT / RESULTS / name).read_text())
    argv = rerun_argv(committed["meta"]["command"], tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    fresh = json.loads((tmp_path / Path(name).name).read_text())
    old, new = figures(committed), figures(fresh)
    assert len(old) > 20, f"{name}: only {len(old)} figures compared"
    changed = {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}
    assert not changed, (f"{RESULTS}{name} is stale (committed, fresh): {changed}; regenerate it with "
                         f"`{committed['meta']['command']}` and update the pages that cite it")


def _quoted(doc: dict) -> dict[str, dict[str, str]]:
    """Per strategy of a bench results file, each figure as the pages print it."""
    none = next(s for s in doc["strategies"] if s["name"] == "none")["activation_bytes"]
    out = {}
    for s in (s for s in doc["strategies"] if s["status"] == "ok"):
        r = doc["ratios"][s["name"]]
        lo, hi = r["cpu_time_x_none_ci95"]
        verdict = "reference" if s["name"] == "none" else (
            "bitwise equal" if s["correctness"]["bitwise_equal"] else "differ")
        out[s["name"]] = {
            "wall": f"{s['times']['median_s'] * 1e3:.1f}",
            "cpu": f"{statistics.median(s['times']['cpu_seconds']) * 1e3:.1f}",
            "x_none": "1.000" if s["name"] == "none" else f"{r['cpu_time_x_none']:.3f} [{lo:.3f}-{hi:.3f}]",
            "act": f"{s['activation_bytes'] / 2**20:.1f}", "act_x": f"{s['activation_bytes'] / none:.3f}",
            "host": f"{s['host_copy_bytes'] / 2**20:.1f}", "verdict": verdict}
    return out


def _table_rows(page: Path, header: str) -> dict[str, list[str]]:
    """The rows of the table whose header row starts with ``header``, by the first word of the first cell."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].split()[0]] = cells[1:]
    return rows


@pytest.mark.parametrize("page, header, columns", [
    ("README.md", "| strategy | CPU time × none", ("x_none", "act", "verdict")),
    ("docs/benchmarks.md", "| strategy | wall ms", ("wall", "cpu", "x_none", "act", "act_x", "host", "verdict")),
])
def test_results_tables_quote_the_committed_file(page, header, columns):
    """The README's and the benchmarks page's results tables print the figures of the file they cite."""
    quoted = _quoted(json.loads((ROOT / RESULTS / "tiny_L4_s256_b2_float32.json").read_text()))
    rows = _table_rows(ROOT / page, header)
    assert len(rows) >= 6, rows
    for name, cells in rows.items():
        want = [quoted[name][c] for c in columns]
        got = [c if c != "reference (repeats bitwise)" else "reference" for c in cells]
        assert got == want, f"{page}, row {name}: {got} but the file gives {want}"
