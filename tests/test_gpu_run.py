"""scripts/gpu_run.sh cannot rot between GPU runs (issue 36 items 1 and 5, issue 41): its --dry-run runs the
same phases at tiny sizes on CPU (the emulated accelerator where a phase needs a device), plans them within a
time budget, and copies what it has into $OUT after every phase, so a kill mid-phase (the device tool's
time limit) still returns the earlier phases' files, within the tool's limits (8 files, 2 folders deep). The two
calls of docs/gpu-run.md share one run's folder without appending to each other, and a test process that has
GPU-trace callbacks registered fails the clean check (scripts/pytest_gpu_trace.py)."""

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


CALL1 = ("env", "errors", "sanitizer", "probe")
CALL2 = ("plans", "8b", "predict")
"""docs/gpu-run.md's two calls, dry, less what repeats a phase shown here (CI time): the tests phase is the errors
phase's pytest process with another selection, call 2's env is call 1's, its 1b-hooks and long phases are plain bench
runs of strategies tested in tests/bench."""


def _call(clone: Path, out: Path, res: Path, label: str, phases: tuple[str, ...]) -> dict[str, dict]:
    proc = subprocess.run(["bash", SCRIPT, "--dry-run", "--budget", "400", "--commit", "deadbee", "--results", str(res),
                           "--label", label, *phases], cwd=clone, env=_env(out), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    phases_run = _summary(out, f"summary_{label}.json")
    assert [p for p, s in phases_run.items() if s["status"] != "ok"] == [], phases_run
    _within_device_limits(out)
    return phases_run


def test_the_two_calls_dry_return_every_phase_into_one_run_folder(clone, tmp_path):
    """Call 1's and call 2's phases, dry, into one run's folder: each ends ok; each call's $OUT holds the results
    tar, streamed log, summary and test logs within the device tool's limits; the calls' own files do not collide
    and nothing is appended (one session per test log); the errors phase's tests ran without a GPU-trace callback
    (recorded), every phase's host load is recorded, the environment record has the commit, the host CPU
    and the callback count; the bench ran a partial offload with two traced steps, the plans met their budgets
    beside none/ac/offload_ac, the predict phase put every predictable strategy beside its prediction; and the
    checkout is not touched."""
    res = tmp_path / "res" / "dry-run-cpu" / "2026-01-01-deadbee"
    one = _call(clone, tmp_path / "out1", res, "call1", CALL1)
    two = _call(clone, tmp_path / "out2", res, "call2", CALL2)
    trace = one["errors"]["gpu_trace"]
    assert (trace["callbacks"], trace["sanitizer_imported"], trace["violation"]) == (0, False, ""), trace
    for row in [*one.values(), *two.values()]:
        load = row["load"]
        assert load is None or (load["loadavg_1m_start"] >= 0 and 0 <= load["cpu_busy_pct"] <= 100), row
    names = _tar_names(tmp_path / "out2")
    assert {"env_call1.json", "summary_call1.json", "gpu_run_call1.log", "errors.xml", "sanitizer.xml", "probe.json",
            "summary_call2.json", "gpu_run_call2.log", "tiny_L2_s24_b2_float32.json",
            "plan_tiny_L2_s16_b2_float32.json", "predicted_vs_measured.json", "predicted_vs_measured.md",
            "trace_tiny_L2_s24_b2_float32_none.json.gz", "trace_tiny_L2_s24_b2_float32_offload_part.json.gz"} <= names
    for log in ("errors.txt", "sanitizer.txt"):
        text = (tmp_path / "out1" / log).read_text()
        assert text.count("test session starts") == 1 and " passed" in text, log
    assert "== [8b]" not in (res / "gpu_run_call1.log").read_text()
    assert "== [8b] ok" in (res / "gpu_run_call2.log").read_text()
    env = json.loads((res / "env_call1.json").read_text())
    assert env["git_commit"] == "deadbee" and env["virtual_memory"]["total"] > 0
    assert env["gpu_trace"]["callbacks"] == 0 and env["gpu_trace"]["registries_checked"] >= 10
    assert env["cpu"]["logical_cores"] > 0 and "model" in env["cpu"] and "loadavg_1_5_15m" in env["cpu"]
    bench = json.loads((res / "tiny_L2_s24_b2_float32.json").read_text())
    assert bench["meta"]["git_commit"] == "deadbee" and bench["meta"]["gpu_trace_at_end"]["callbacks"] == 0
    ran = {s["name"]: s for s in bench["strategies"] if s["status"] == "ok"}
    assert set(ran) == {"none", "offload_part", "account_only_python"}  # the others skipped by name (dry)
    assert all(s["correctness"]["bitwise_equal"] for n, s in ran.items() if n != "none")
    assert {n for n, s in ran.items() if s.get("trace")} == {"none", "offload_part"}
    assert all(s["trace"]["file"] in names for s in ran.values() if s.get("trace"))
    plans = json.loads((res / "plan_tiny_L2_s16_b2_float32.json").read_text())
    assert [a["name"] for a in plans["arms"]] == ["none", "ac", "offload_ac"]
    assert [p["fraction"] for p in plans["planned"]] == [0.7, 0.5]
    assert all(p["measured_peak_bytes"] <= p["budget_bytes"] for p in plans["planned"] if p["status"] == "ok")
    pvm = {f["measured_file"]: f["strategies"] for f in
           json.loads((res / "predicted_vs_measured.json").read_text())["files"]}
    rows = pvm["tiny_L2_s24_b2_float32.json"]
    assert {n for n, r in rows.items() if (r["predicted"] or {}).get("status") == "ok"} == {"none", "offload_part"}
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
    # The same call again (a rerun): its log and summary are replaced, not appended to.
    again = subprocess.run(["bash", SCRIPT, "--dry-run", "--budget", "300", "--label", "call2", "--results",
                            str(tmp_path / "res"), "tests"], cwd=ROOT, env={**_env(out), "GPU_RUN_EST_tests": "100000"},
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert (tmp_path / "res" / "gpu_run_call2.log").read_text().count(" device dry-run-cpu (dry run)") == 1
    assert list(_summary(out, "summary_call2.json")) == ["tests"]


def test_the_long_phase_is_skipped_with_the_reason_where_the_strategy_is_missing(tmp_path):
    """A tree whose bench has no long_context strategy skips the long phase, saying why, and fails nothing."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "gpu_run.sh").write_text((ROOT / SCRIPT).read_text())
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "strategies.py").write_text('"""No long_context here."""\n')
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/gpu_run.sh", "--dry-run", "--results", str(tmp_path / "res"), "long"],
                          cwd=tmp_path, env=_env(out), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    long = _summary(out)["long"]
    assert long["status"] == "skipped" and "no long_context strategy" in long["reason"], long


_IMPORTS_THE_SANITIZER = """
import torch.cuda._sanitizer  # noqa: F401  (what the H200 runs' test processes had, through offload.testing)

def test_passes():
    assert True
"""


def test_a_test_process_with_gpu_trace_callbacks_fails_the_clean_check(tmp_path):
    """scripts/pytest_gpu_trace.py with --gpu-trace off: a session whose process imported torch.cuda._sanitizer
    (ten callbacks on every CUDA allocation) fails though its tests pass, says why, and records the state."""
    (tmp_path / "test_dirty.py").write_text(_IMPORTS_THE_SANITIZER)
    record = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "pytest_gpu_trace", "--gpu-trace", "off", "--gpu-trace-record",
         str(record), "-p", "no:cacheprovider", "-q", "test_dirty.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env=dict(os.environ, PYTHONPATH=f"{ROOT / 'scripts'}:{ROOT}"))
    assert proc.returncode == 1 and "1 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "GPU TRACE CHECK FAILED (--gpu-trace off)" in proc.stdout and "sanitizer is imported" in proc.stdout
    state = json.loads(record.read_text())
    assert state["callbacks"] >= 10 and state["sanitizer_imported"] and state["expected"] == "off"


def test_bad_arguments_and_no_gpu_say_what_to_do(tmp_path):
    """An unknown phase or a malformed budget exits 2 naming it; without a GPU and without --dry-run the
    script says to use --dry-run."""
    env = _env(tmp_path / "out")
    for args, says in ((["nope"], "unknown phase 'nope'"), (["--budget", "5m"], "--budget '5m' must be whole"),
                       (["--run", "a/b"], "--run 'a/b' may hold only"), ([], "--dry-run")):
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
