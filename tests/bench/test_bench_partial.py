"""The bench keeps what it measured (issue 36 item 2): results are written after every strategy, a
strategy that crashes is recorded and the others run on, a lost CUDA context stops the run with the
missing strategies named, and a killed run leaves a file that says what it did not finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import cli, harness
from bench.harness import BenchConfig, run_bench
from bench.strategies import STRATEGIES, Prepared, StrategySpec
from bench.workloads import PRESETS

ROOT = Path(__file__).resolve().parents[2]
WL = PRESETS["tiny"].replace(dim=64, n_heads=1, n_layers=1, seq_len=16, vocab_size=64)
MICRO = ["--dim", "64", "--layers", "1", "--seq", "16", "--batch", "2", "--vocab", "64",
         "--steps", "1", "--warmup", "0", "--quiet", "--no-probe", "--no-plot", "--device", "cpu"]


def _crashing(where: str):
    """A strategy that raises in ``where`` ("prepare" or "step"), as a compile error or a kernel fault would."""

    def prepare(env):
        if where == "prepare":
            raise RuntimeError("simulated compile error (torch 2.11)")

        def step():
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

        return Prepared(step=step)

    return StrategySpec(name=f"crash_{where}", description="raises", prepare=prepare, group="control")


@pytest.fixture
def crashers(monkeypatch):
    for where in ("prepare", "step"):
        spec = _crashing(where)
        monkeypatch.setitem(STRATEGIES, spec.name, spec)


@pytest.mark.parametrize("order", ["sequential", "interleaved"])
def test_a_crashing_strategy_is_recorded_and_the_others_still_run(crashers, order):
    """A strategy that raises in prepare or in its step is recorded as an error with the exception; every
    other strategy runs and stays bitwise equal to none."""
    cfg = BenchConfig(workload=WL, strategies=("none", "crash_prepare", "offload", "crash_step", "ac"),
                      steps=1, warmup=0, order=order, progress=False)
    result = run_bench(cfg, {"device": "cpu"})
    by = {s.name: s for s in result.strategies}
    assert by["crash_prepare"].status == "error" and "simulated compile error" in by["crash_prepare"].reason
    assert by["crash_step"].status == "error" and "illegal memory access" in by["crash_step"].reason
    for name in ("none", "offload", "ac"):
        assert by[name].ok and by[name].correctness.bitwise_equal, (name, by[name].reason)
    assert "partial" not in result.meta  # every strategy has its result (errors are results)


def test_results_are_published_after_every_strategy(crashers):
    """on_update sees all strategies pending first, then one more final result after each strategy."""
    seen = []
    cfg = BenchConfig(workload=WL, strategies=("none", "crash_step", "offload"), steps=1, warmup=0,
                      order="sequential", progress=False)
    run_bench(cfg, {"device": "cpu"}, on_update=lambda r: seen.append([s.status for s in r.strategies]))
    assert seen == [["pending"] * 3,
                    ["ok", "pending", "pending"],
                    ["ok", "error", "pending"],
                    ["ok", "error", "ok"]], seen


def _interrupting(where: str, wrapped: bool):
    """A strategy whose ``where`` ("prepare" or "step") is interrupted by Ctrl-C: the KeyboardInterrupt itself, or
    (``wrapped``) an error raised while handling it (a library wrapping it, a worker the same Ctrl-C stopped)."""

    def interrupt():
        if not wrapped:
            raise KeyboardInterrupt
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly (simulated)")

    def prepare(env):
        if where == "prepare":
            interrupt()
        return Prepared(step=interrupt)

    return StrategySpec(name=f"ctrl_c_{where}", description="interrupted", prepare=prepare, group="control")


@pytest.mark.parametrize("wrapped", [False, True], ids=["interrupt", "error_from_interrupt"])
@pytest.mark.parametrize("where", ["prepare", "step"])
@pytest.mark.parametrize("order", ["sequential", "interleaved"])
def test_an_interrupt_stops_the_run_instead_of_becoming_a_strategys_error(monkeypatch, where, wrapped, order):
    """Ctrl-C in a strategy (or an error raised from it) stops the whole run with KeyboardInterrupt, as a test
    run that calls the bench must stop (issue 45 item 7); no later strategy runs."""
    spec = _interrupting(where, wrapped)
    monkeypatch.setitem(STRATEGIES, spec.name, spec)
    ran = []
    monkeypatch.setattr(harness._Bench, "prepare", lambda self, r, _p=harness._Bench.prepare: (ran.append(r.spec.name),
                                                                                           _p(self, r))[1])
    cfg = BenchConfig(workload=WL, strategies=("none", spec.name, "offload"), steps=1, warmup=0, order=order,
                      progress=False)
    with pytest.raises(KeyboardInterrupt):
        run_bench(cfg, {"device": "cpu"})
    assert order == "interleaved" or "offload" not in ran, ran


def test_an_interrupt_is_not_replaced_by_a_failing_last_write(monkeypatch):
    """The file is rewritten once more after an interrupt; when that write fails, the interrupt still ends the
    run (the write's error is printed, not raised in its place)."""
    spec = _interrupting("step", False)
    monkeypatch.setitem(STRATEGIES, spec.name, spec)
    calls = []

    def write(result):
        calls.append(result)
        if any("interrupted" in (s.reason or "") for s in result.strategies):  # the write after the interrupt
            raise OSError("No space left on device (simulated)")

    cfg = BenchConfig(workload=WL, strategies=("none", spec.name), steps=1, warmup=0, order="sequential",
                      progress=False)
    with pytest.raises(KeyboardInterrupt):
        run_bench(cfg, {"device": "cpu"}, on_update=write)
    assert any("interrupted" in (s.reason or "") for s in calls[-1].strategies)


def test_a_lost_cuda_context_stops_the_run_and_names_what_is_missing(crashers, monkeypatch, tmp_path):
    """After an error that leaves the device unusable (a sticky CUDA error, stubbed here), the strategies
    left are recorded as not_run with the reason and a rerun command; the file keeps the earlier results
    and the exit status is 3."""
    calls = []

    def unusable(device):
        calls.append(device)
        return "RuntimeError: CUDA error: an illegal memory access was encountered"

    monkeypatch.setattr(harness, "device_unusable", unusable)
    out = tmp_path / "run"
    rc = cli.main(MICRO + ["--strategies", "none,offload,crash_step,ac,offload_ac", "--order", "sequential",
                           "--out", str(out)])
    assert rc == 3 and len(calls) == 1
    (path,) = out.glob("*.json")
    data = json.loads(path.read_text())
    by = {s["name"]: s for s in data["strategies"]}
    assert by["none"]["status"] == by["offload"]["status"] == "ok"
    assert by["offload"]["correctness"]["grads_equal"]
    assert by["crash_step"]["status"] == "error"
    for name in ("ac", "offload_ac"):
        assert by[name]["status"] == "not_run" and "context was unusable after crash_step" in by[name]["reason"]
    partial = data["meta"]["partial"]
    assert set(partial["missing"]) == {"ac", "offload_ac"}
    assert partial["rerun"].endswith("--strategies none,ac,offload_ac")
    assert "not_run" in (out / path.with_suffix(".md").name).read_text()


_HANGING_RUN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from bench import cli
    from bench.strategies import STRATEGIES, Prepared, StrategySpec

    def prepare(env):
        def step():
            Path(sys.argv[1]).touch()  # the kill may come now
            time.sleep(120)
        return Prepared(step=step)

    STRATEGIES["hang"] = StrategySpec(name="hang", description="sleeps", prepare=prepare, group="control")
    sys.exit(cli.main(sys.argv[2:]))
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_bench_leaves_the_strategies_it_finished(tmp_path, sig):
    """Killed in the middle of a strategy, the bench's JSON holds the strategies that finished (bitwise
    verdicts included) and lists the rest: not_run with the interrupt after SIGTERM, pending after SIGKILL."""
    out, started = tmp_path / "run", tmp_path / "started"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", _HANGING_RUN, str(started),
         *MICRO, "--strategies", "none,offload,hang,ac", "--order", "sequential", "--out", str(out)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the hanging strategy never started"
            time.sleep(0.1)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    (path,) = out.glob("*.json")
    by = {s["name"]: s for s in json.loads(path.read_text())["strategies"]}
    assert by["none"]["status"] == by["offload"]["status"] == "ok"
    assert by["offload"]["correctness"]["grads_equal"] and by["offload"]["engine"]["offloaded_bytes"] > 0
    expected = "not_run" if sig == signal.SIGTERM else "pending"
    assert by["hang"]["status"] == by["ac"]["status"] == expected, by["hang"]
    if sig == signal.SIGTERM:
        assert "interrupted (SystemExit)" in by["ac"]["reason"]
    assert not list(out.glob(".*tmp*")), "a temporary file was left behind"
