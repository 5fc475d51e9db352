"""scripts/gpu_run.sh cannot rot between GPU runs (issue 36 items 1 and 5): its --dry-run runs the same
phases at tiny sizes on CPU (the emulated accelerator where a phase needs a device), plans them within a
time budget, and copies what it has into $OUT after every phase, so a kill mid-phase (the device tool's
time limit) still returns the earlier phases' files, within the tool's limits (8 files, 2 folders deep)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "scripts/gpu_run.sh"
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the GPU machine and its script are Linux/bash")


def _env(out: Path) -> dict[str, str]:
    return dict(os.environ, OUT=str(out), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", PACK_EVERY="2",
                PYTHONPATH="")


def _summary(out: Path, name: str = "summary.json") -> dict[str, dict]:
    return {p["phase"]: p for p in json.loads((out / name).read_text())["phases"]}


def _tar_names(out: Path) -> set[str]:
    (tar,) = out.glob("results_*.tar.gz")
    with tarfile.open(tar) as t:
        return {Path(n).name for n in t.getnames()}


def _within_device_limits(out: Path) -> None:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for p in files:
        assert len(p.relative_to(out).parts) <= 3, p  # $OUT/a/b/file at most
        assert p.stat().st_size <= 16 << 20, p
        assert not p.name.startswith("."), f"a temporary file came back: {p}"


def test_dry_run_returns_every_phase_and_leaves_the_checkout_clean(clone, tmp_path):
    """Call 1's and call 2's phases, dry: each ends ok, $OUT holds the results tar, streamed log, summary and
    test logs within the device tool's limits, the environment record has the commit passed in and the host
    memory, the predict phase put each measured preset's strategies beside their prediction, and the
    checkout is not touched."""
    out, res = tmp_path / "out", tmp_path / "res"
    proc = subprocess.run(
        ["bash", SCRIPT, "--dry-run", "--budget", "400", "--commit", "deadbee", "--results", str(res),
         "env", "tests", "probe", "1b", "sanitizer", "8b", "predict"],
        cwd=clone, env=_env(out), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    phases = _summary(out)
    assert [p for p, s in phases.items() if s["status"] != "ok"] == [], phases
    _within_device_limits(out)
    names = _tar_names(out)
    assert {"env.json", "probe.json", "gpu_tests.xml", "sanitizer.xml", "gpu_run.log", "summary.json",
            "tiny_L1_s16_b2_float32.json", "tiny_L1_s24_b2_float32.json", "predicted_vs_measured.json",
            "predicted_vs_measured.md"} <= names, names
    assert "passed" in (out / "gpu_tests.txt").read_text() and "passed" in (out / "sanitizer.txt").read_text()
    assert "== [8b] ok" in (out / "gpu_run.log").read_text()
    pvm = {f["measured_file"]: f["strategies"] for f in
           json.loads((res / "predicted_vs_measured.json").read_text())["files"]}
    assert {k: list(v) for k, v in pvm.items()} == {"tiny_L1_s16_b2_float32.json": ["none", "offload", "offload_ac",
                                                                                    "offload_part"],
                                                    "tiny_L1_s24_b2_float32.json": ["none", "offload"]}
    assert all(r["measured"]["status"] == "ok" and r["predicted"]["status"] == "ok"
               for v in pvm.values() for r in v.values())
    env = json.loads((res / "env.json").read_text())
    assert env["git_commit"] == "deadbee" and env["virtual_memory"]["total"] > 0
    bench = json.loads((res / "tiny_L1_s16_b2_float32.json").read_text())
    assert bench["meta"]["git_commit"] == "deadbee" and bench["meta"]["emulator"]["hazards"] == 0
    assert subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone,
                          capture_output=True, text=True, check=True).stdout == ""


def _start(tmp_path: Path, *phases: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", SCRIPT, "--dry-run", "--results", str(tmp_path / "res"), *phases],
                            cwd=ROOT, env=_env(out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    return proc, out


def _wait_running(proc: subprocess.Popen, out: Path, phase: str) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, "the script ended before the phase to kill started"
        assert time.monotonic() < deadline, f"phase {phase} never started"
        try:
            if _summary(out)[phase]["status"] == "running":
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_kill_mid_phase_returns_the_earlier_phases(tmp_path, sig):
    """Killed during a phase (SIGTERM to the script, or SIGKILL to its whole process group as the device
    tool does at its limit), $OUT already holds the finished phase's files and a summary naming the phase
    that was cut: "killed" when the script could say so, "running" when it was given no chance."""
    proc, out = _start(tmp_path, "env", "sleep")
    try:
        _wait_running(proc, out, "sleep")
        if sig == signal.SIGTERM:
            proc.send_signal(sig)
        else:
            os.killpg(proc.pid, sig)
        assert proc.wait(timeout=60) == (128 + sig if sig == signal.SIGTERM else -sig)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    phases = _summary(out)
    assert phases["env"]["status"] == "ok"
    assert phases["sleep"]["status"] == ("killed" if sig == signal.SIGTERM else "running"), phases["sleep"]
    assert "env.json" in _tar_names(out)
    _within_device_limits(out)


def test_the_budget_skips_phases_that_do_not_fit(tmp_path):
    """With little budget left, a phase whose estimate exceeds it is skipped and recorded with the reason;
    the phases before it still ran. (--label names the call's own files, so two calls never collide.)"""
    out = tmp_path / "out"
    # The tests phase's estimate is set far above the budget, so the skip does not hang on how long the
    # env phase took on a loaded machine.
    proc = subprocess.run(["bash", SCRIPT, "--dry-run", "--budget", "300", "--label", "call2", "--results",
                           str(tmp_path / "res"), "env", "tests"],
                          cwd=ROOT, env={**_env(out), "GPU_RUN_EST_tests": "100000"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert {"gpu_run_call2.log", "summary_call2.json"} <= {p.name for p in out.iterdir()}
    assert (tmp_path / "res" / "env_call2.json").is_file()
    phases = _summary(out, "summary_call2.json")
    assert phases["env"]["status"] == "ok"
    assert phases["tests"]["status"] == "skipped" and "left of the 300s budget" in phases["tests"]["reason"]


def test_bad_arguments_and_no_gpu_say_what_to_do(tmp_path):
    """An unknown phase or a malformed budget exits 2 naming it; without a GPU and without --dry-run the
    script says to use --dry-run."""
    env = _env(tmp_path / "out")
    for args, says in ((["nope"], "unknown phase 'nope'"), (["--budget", "5m"], "--budget '5m' must be whole"),
                       ([], "--dry-run")):
        proc = subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and says in proc.stderr, (args, proc.stderr)


_SLOW_TESTS = """
import time

def test_hangs():
    try:
        time.sleep(60)
    except Exception:  # the deadline is not an Exception: this cannot swallow it
        pass

def test_after():
    assert True
"""


def test_per_test_deadline_fails_the_slow_test_and_goes_on(tmp_path):
    """scripts/pytest_deadline.py (pytest-timeout may be missing on the GPU machine): a test past its
    deadline fails with the reason, even inside `except Exception`, and the next test still runs."""
    (tmp_path / "test_slow.py").write_text(_SLOW_TESTS)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "pytest_deadline", "--deadline", "1", "-p", "no:cacheprovider",
         "-q", "-rA", "test_slow.py"], cwd=tmp_path, capture_output=True, text=True, timeout=50,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "scripts")))
    assert proc.returncode == 1, proc.stdout
    assert "FAILED test_slow.py::test_hangs" in proc.stdout and "exceeded the per-test deadline" in proc.stdout
    assert "PASSED test_slow.py::test_after" in proc.stdout


def test_gpu_skip_rule_reads_the_marker_not_the_path():
    """The conftest skips tests marked gpu, not every test whose path names a folder called gpu."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_tests_root_conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)  # by path: several folders hold a "conftest" module
    spec.loader.exec_module(conftest)

    def item(marked: bool):
        it = SimpleNamespace(keywords={"gpu": 1, "test_x": 1}, added=[])
        it.get_closest_marker = lambda name: object() if marked and name == "gpu" else None
        it.add_marker = it.added.append
        return it

    items = [item(True), item(False)]
    if conftest.torch.cuda.is_available():
        pytest.skip("the rule only acts without CUDA")
    conftest.pytest_collection_modifyitems(None, items)
    assert len(items[0].added) == 1 and items[1].added == []
