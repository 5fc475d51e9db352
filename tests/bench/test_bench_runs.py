"""The main job behaves: it leaves a checkout clean, says what GPU-only commands need, shows progress,
and the package installs without side effects (no torchao import, a version, type markers)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

from pathlib import Path

import pytest
import torch

import offload
from bench import cli, profiler_overhead
from bench.env import default_run_dir
from bench.harness import BenchConfig, run_bench
from bench.workloads import PRESETS

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
MICRO = ["--dim", "32", "--layers", "1", "--seq", "16", "--batch", "1", "--vocab", "64", "--steps", "1",
         "--warmup", "0", "--strategies", "none,offload,save_on_cpu", "--quiet"]


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(root), CUDA_VISIBLE_DEVICES="")
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    return env


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("cmd", [
    ["-m", "bench", *MICRO],
    ["-m", "bench.probe", "--max-mb", "1"],
    ["-m", "bench.profiler_overhead", "--steps", "1", "--warmup", "0", "--dim", "32", "--seq", "16",
     "--skip", "module_stats", "memprofiler_collecting", "engine+memprofiler", "--quiet"],
], ids=["bench", "probe", "profiler_overhead"])
def test_main_jobs_leave_the_checkout_clean(clone, cmd):
    """`python -m bench` (and bench.probe, bench.profiler_overhead) run from a clean clone write their
    files into ./bench_runs/<run>/ (gitignored) and modify no tracked file."""
    proc = subprocess.run([sys.executable, *cmd], cwd=clone, env=_env(clone), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _git(clone, "status", "--porcelain", "--untracked-files=all") == "", "the run left the checkout dirty"
    written = re.findall(r"^wrote (.+)$", proc.stdout, flags=re.M)
    assert written, proc.stdout
    for path in map(Path, written):
        assert path.is_file() and (clone / "bench_runs") in path.parents, path


def test_default_run_dirs_are_outside_the_package(tmp_path, monkeypatch):
    """Default output folders live under the current directory, never inside the installed packages."""
    monkeypatch.chdir(tmp_path)
    packages = [Path(m.__file__).resolve().parent for m in (offload, cli)]
    for path in (default_run_dir("bench", "tiny"), profiler_overhead.default_out()):
        assert tmp_path in path.parents
        assert not any(pkg in path.parents for pkg in packages), path
    assert cli.parse_args([]).out is None  # --out is the only way to write elsewhere (bench/results/...)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on a machine without a GPU")
@pytest.mark.parametrize("argv", [["--preset", "8b", "--seq", "8192"], ["--preset", "1b"], ["--device", "cuda"]])
def test_gpu_only_invocations_stop_at_once_on_cpu(argv, capsys):
    """GPU-sized runs on a CPU machine return 2 before building anything, saying what to run instead."""
    assert cli.main(argv + ["--quiet", "--no-write"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "python -m bench " in err and "On CPU run" in err


def test_progress_total_leaves_out_skipped_strategies(capsys):
    """The bar's total counts only steps that run: a strategy skipped on CPU drops its steps from it."""
    wl = PRESETS["tiny"].replace(dim=32, n_heads=1, n_layers=1, seq_len=16, batch=1, vocab_size=64)
    cfg = BenchConfig(workload=wl, strategies=("none", "compile", "offload"), steps=2, warmup=1, progress=True)
    result = run_bench(cfg, {"device": "cpu"})
    assert result.get("compile").status == "skipped"
    counts = re.findall(r"(\d+)/(\d+) \[", capsys.readouterr().err)
    assert counts, "no progress bar on stderr"
    done, total = map(int, counts[-1])
    assert done == total == 2 * (1 + 2 + 1)  # two runnable strategies x (warm-up + measured + memory step)


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_torchrun_example_refuses_more_ranks_than_cores_on_cpu(monkeypatch, capsys):
    """The 8-rank line on a CPU machine stops at once, saying it needs GPUs and what to type instead."""
    example = _load_example("torchrun_fsdp2")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit, match=r"(?s)need a GPU each.*torchrun --nproc_per_node=2 examples/torchrun_fsdp2.py"):
        example._check_world_fits(8, 8)
    example._check_world_fits(2, 2)  # the CPU default passes


@pytest.mark.distributed
def test_torchrun_example_launches_itself_without_torchrun(tmp_path):
    """`python examples/torchrun_fsdp2.py` (no RANK) starts 2 local ranks instead of KeyError: 'RANK'."""
    env = {k: v for k, v in _env(ROOT).items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "torchrun_fsdp2.py"), "--steps", "1",
                           "--out", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "launching 2 local processes" in proc.stdout
    assert {p.name for p in tmp_path.glob("ledger_rank*.json")} == {"ledger_rank0.json", "ledger_rank1.json"}


# ---------------------------------------------------------------- packaging


def test_importing_offload_does_not_import_torchao():
    """torchao is optional (offload[qlora]): importing the packages must not load it (nor its extensions)."""
    code = ("import sys, offload, offload.profiling, bench.cli; "
            "assert 'torchao' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torchao'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(ROOT), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("module", ["numpy", "scipy"])
def test_bench_on_a_core_install_names_its_extra(module):
    """`python -m bench` without a module of the bench extra (blocked, as on a core install) exits 1 with one
    line naming the extra and its install command, not a traceback ending in "No module named"; the extra
    lists the module, and bench.model (the examples' toy Llama) still imports without it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert module in extras["bench"]
    block = f"import sys; sys.modules[{module!r}] = None\n"
    run = block + "import runpy; sys.argv = ['bench', '--list']; runpy.run_module('bench', run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", run], cwd=ROOT, env=_env(ROOT), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"the bench needs {module}" in proc.stderr and 'pip install -e ".[bench]"' in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-c", block + "import bench.model"], cwd=ROOT, env=_env(ROOT),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


_BLOCK_EXTRA = "import sys\nfor m in ('numpy', 'scipy', 'matplotlib'): sys.modules[m] = None\n"
"""A core install, as far as the bench's imports can tell."""

_EACH_MAIN = _BLOCK_EXTRA + """
import contextlib, io, json, runpy
out = {}
for mod in MODULES:
    sys.argv = [mod, "--help"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_module(mod, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException as e:
            sys.excepthook(type(e), e, e.__traceback__)  # what Python does with an uncaught exception
            code = 1
    out[mod] = [code, err.getvalue()]
print(json.dumps(out))
"""


def test_every_bench_main_on_a_core_install_names_its_extra():
    """Every bench module with a __main__ (`python -m bench.probe`, ...) run without the bench extra either
    works (its --help) or exits 1 with one line naming the extra and its install command, never a
    traceback; the extra's modules are the ones pyproject.toml lists."""
    import json

    import bench

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(bench.EXTRA_MODULES) == sorted(extras["bench"])
    mains = ["bench"] + sorted(f"bench.{p.stem}" for p in (ROOT / "bench").glob("*.py")
                               if p.stem != "__main__" and 'if __name__ == "__main__":' in p.read_text())
    assert "bench.probe" in mains and len(mains) > 5, mains
    proc = subprocess.run([sys.executable, "-c", f"MODULES = {mains!r}\n" + _EACH_MAIN], cwd=ROOT, env=_env(ROOT),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    named = 0
    for mod, (code, err) in json.loads(proc.stdout.splitlines()[-1]).items():
        assert code in (0, 1) and "Traceback" not in err, (mod, code, err[-2000:])
        if code == 1:
            line = [ln for ln in err.splitlines() if "the bench needs" in ln]
            assert len(line) == 1 and 'pip install -e ".[bench]"' in line[0], (mod, err)
            named += 1
    assert named >= 1, "no bench module needs the extra at start: the test checks nothing"


def test_a_bench_command_names_the_extra_wherever_it_is_first_imported(tmp_path):
    """`python -m bench.probe` on a core install exits 1 with one line (its command, the extra, how to install
    it), no traceback; a module of the extra first imported late in a run (inside main) is reported the same."""
    (tmp_path / "sitecustomize.py").write_text(_BLOCK_EXTRA)  # numpy & co. blocked before `-m` runs
    env = dict(_env(ROOT), PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    for cmd, prog, module in ((["-m", "bench.probe"], "python -m bench.probe", "numpy"),
                              (["-c", "import bench\ndef main():\n    import scipy\nmain()"], "bench", "scipy")):
        proc = subprocess.run([sys.executable, *cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = [ln for ln in proc.stderr.splitlines() if "the bench needs" in ln]
        assert lines == [f'{prog}: the bench needs {module}, which is not installed: install the `bench` extra, '
                         'pip install -e ".[bench]" (from the checkout; `.[test]` includes it)'], proc.stderr


def test_pyproject_declares_torchao_optional_and_tqdm():
    """torchao lives in the qlora extra (and the test extra, so CI tests NF4); tqdm is a dependency."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {re.split(r"[<>=\[ ]", d)[0] for d in project["dependencies"]}
    assert "torchao" not in deps and "tqdm" in deps
    extras = project["optional-dependencies"]
    assert extras["qlora"] == ["torchao"] and "torchao" in extras["test"]


def test_version_and_type_markers():
    """offload.__version__ matches pyproject; both packages ship py.typed (package-data)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert offload.__version__ == data["project"]["version"]
    assert "__version__" in offload.__all__
    for folder, pkg in (("offload", "offload"), ("profiling", "offload.profiling")):
        assert (ROOT / folder / "py.typed").is_file()
        assert "py.typed" in data["tool"]["setuptools"]["package-data"][pkg]


@pytest.mark.emulated
def test_bench_emulate_reports_zero_hazards_in_its_json(tmp_path, capsys):
    """python -m bench --emulate: our engine's strategies on the emulated accelerator (late data, every op
    checked); the JSON says how many ops were checked and that no hazard was found."""
    import json

    from bench.cli import main

    out = tmp_path / "run"
    rc = main(["--emulate", "--steps", "1", "--warmup", "0", "--seq", "64", "--layers", "2", "--no-plot",
               "--quiet", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    (path,) = out.glob("*.json")
    data = json.loads(path.read_text())
    e = data["meta"]["emulator"]
    assert e["hazards"] == 0 and e["ops_checked"] > 1000 and e["late_ops_run"] > 0 and e["late"] is True
    ran = {s["name"] for s in data["strategies"] if s["status"] == "ok"}
    assert {"offload", "offload_ac", "offload_head_excluded"} <= ran
    assert "0 hazard(s)" in capsys.readouterr().out



def test_offload_verify_strategy_runs_bitwise_and_is_not_in_the_default_run(tmp_path):
    """The bench measures verify=True's cost as its own strategy, bitwise like `offload`; the default run
    (and its committed tables) leaves the debugging mode out."""
    from bench.strategies import DEFAULT_ORDER, STRATEGIES

    assert "offload_verify" in STRATEGIES and "offload_verify" not in DEFAULT_ORDER
    cfg = BenchConfig(workload=PRESETS["tiny"].replace(seq_len=32, n_layers=1), strategies=("none", "offload_verify"),
                      device="cpu", steps=1, warmup=0, order="sequential", progress=False)
    result = run_bench(cfg, {}, None)
    s = result.get("offload_verify")
    assert s.ok and s.correctness.bitwise_equal and s.correctness.grads_compared > 0, (s.status, s.correctness)


def test_partial_offload_strategies_offload_only_the_first_blocks_bitwise():
    """offload_part / offload_part_bytes (the GPU run's partial offload): bitwise like `offload`, moving some
    but not all of what it moves, the rest kept as an excluded region; the exclusion is removed after the
    strategy, so `offload` run after them moves everything again. Not in the default run."""
    from bench.strategies import DEFAULT_ORDER, part_blocks

    assert {"offload_part", "offload_part_bytes"}.isdisjoint(DEFAULT_ORDER)
    assert [part_blocks(n) for n in (1, 4, 16, 32)] == [1, 1, 3, 6]
    wl = PRESETS["tiny"].replace(seq_len=32, n_layers=4)
    cfg = BenchConfig(workload=wl, strategies=("none", "offload_part", "offload_part_bytes", "offload"),
                      device="cpu", steps=1, warmup=0, order="sequential", progress=False)
    result = run_bench(cfg, {}, None)
    full = result.get("offload")
    assert full.ok and full.correctness.bitwise_equal, (full.status, full.correctness)
    for name in ("offload_part", "offload_part_bytes"):
        s = result.get(name)
        assert s.ok and s.correctness.bitwise_equal and s.correctness.grads_compared > 0, (s.status, s.correctness)
        assert 0 < s.engine.offloaded_bytes < full.engine.offloaded_bytes / 2, (name, s.engine.offloaded_bytes)
        assert s.engine.kept_by_reason.get("excluded_region", 0) > 0, s.engine.kept_by_reason
    assert full.engine.kept_by_reason.get("excluded_region", 0) == 0, full.engine.kept_by_reason
