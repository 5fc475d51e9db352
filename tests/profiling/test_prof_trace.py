"""TraceProfiler: schedule, templated names, gzip, memory timeline, pruning, summaries."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from torch import nn

from offload.profiling import ProfilingError, TraceProfiler


def _step(model: nn.Module) -> None:
    model(torch.randn(4, 32)).sum().backward()


@pytest.fixture
def net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def test_schedule_names_and_summary(tmp_path, net):
    """wait=1, warmup=1, active=2, repeat=2 saves traces after steps 4 and 8, named by rank and step."""
    with TraceProfiler(folder=str(tmp_path / "{run_name}"), run_name="exp", wait=1, warmup=1, active=2,
                       repeat=2) as tp:
        for _ in range(9):
            _step(net)
            tp.step()
    folder = tmp_path / "exp"
    assert sorted(p.name for p in folder.glob("*.json")) == ["rank0.4.pt.trace.json", "rank0.8.pt.trace.json"]
    trace = json.loads((folder / "rank0.4.pt.trace.json").read_text())
    assert any("aten::addmm" in ev.get("name", "") for ev in trace["traceEvents"])
    summary = (folder / "rank0.summary.txt").read_text()
    assert "sorted by cpu_time_total" in summary and "sorted by self_cpu_memory_usage" in summary
    assert "aten::addmm" in summary
    assert tp.summary() == summary and [s for s, _ in tp.saved_traces] == [4, 8]


def test_gzip_memory_timeline_and_pruning(tmp_path, net):
    """use_gzip writes gzip JSON; the memory timeline is exported; only the newest trace is kept."""
    tp = TraceProfiler(folder=str(tmp_path), filename="t.{step}.json", use_gzip=True,
                       memory_filename="m.{step}.json", record_shapes=True, with_stack=True,
                       warmup=0, active=1, repeat=3, num_traces_to_keep=1, summary_filename=None)
    with tp:
        for _ in range(3):
            _step(net)
            tp.step()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["m.3.json", "t.3.json.gz"]
    with gzip.open(tmp_path / "t.3.json.gz", "rt") as f:
        assert "traceEvents" in json.load(f)
    times, sizes = json.loads((tmp_path / "m.3.json").read_text())
    assert len(times) == len(sizes) > 0
    assert [s for s, _ in tp.saved_traces] == [3]


def test_folder_must_be_empty_without_overwrite(tmp_path, net):
    """A non-empty trace folder is refused unless overwrite=True."""
    (tmp_path / "old.json").write_text("{}")
    with pytest.raises(ProfilingError, match="not empty and overwrite=False"):
        TraceProfiler(folder=str(tmp_path)).start()
    with TraceProfiler(folder=str(tmp_path), overwrite=True, active=1) as tp:
        _step(net)
        tp.step()
    assert (tmp_path / "rank0.1.pt.trace.json").exists()


def test_bad_arguments():
    """Memory-timeline prerequisites, suffixes, schedule values and step() outside a run are checked."""
    with pytest.raises(ValueError, match=r"needs \['record_shapes', 'with_stack'\]"):
        TraceProfiler(memory_filename="m.html")
    with pytest.raises(ValueError, match="must end with one of"):
        TraceProfiler(memory_filename="m.txt", record_shapes=True, with_stack=True)
    with pytest.raises(ValueError, match="active=0"):
        TraceProfiler(active=0)
    with pytest.raises(ProfilingError, match="outside start"):
        TraceProfiler().step()


def test_memory_bounded_over_cycles(tmp_path, net):
    """Events held by the profiler do not grow with the number of cycles (acc_events kept them all),
    while the summary still covers every cycle."""
    tp = TraceProfiler(folder=str(tmp_path), warmup=0, active=1, repeat=0, num_traces_to_keep=1,
                       summary_filename=None, run_name="r")
    held: list[int] = []
    ready = tp._on_trace_ready

    def spy(prof):
        held.append(len(prof.events()))
        ready(prof)

    tp._on_trace_ready = spy
    with tp:
        for _ in range(12):
            _step(net)
            tp.step()
    assert len(held) >= 11
    assert max(held[1:]) <= 1.5 * held[1], held  # with acc_events: about held[1] * cycle index
    addmm = [e for e in tp._averages.values() if e.key == "aten::addmm"]
    assert addmm and addmm[0].count >= 2 * 11  # two Linear forwards per step, every cycle merged
    assert "aten::addmm" in tp.summary()


def test_templates_checked_at_construction():
    """An unknown placeholder fails when the profiler is built, naming the setting and the choices."""
    with pytest.raises(ValueError, match=r"filename=.*\{epoc\}.*use one of"):
        TraceProfiler(filename="rank{rank}.{epoc}.json")
    with pytest.raises(ValueError, match=r"folder=.*\{step\}"):
        TraceProfiler(folder="{run_name}/{step}")  # the folder is fixed before any step
    with pytest.raises(ValueError, match="summary_filename"):
        TraceProfiler(summary_filename="{nope}.txt")


def test_composer_time_variables(tmp_path, net):
    """{epoch}, {batch_in_epoch}, {sample} and {token} are filled from step()/new_epoch() in a plain loop."""
    tp = TraceProfiler(folder=str(tmp_path), warmup=0, active=1, repeat=0, summary_filename=None,
                       filename="e{epoch}.b{batch}.bie{batch_in_epoch}.s{sample}.t{token}.json", run_name="r")
    with tp:
        for epoch in range(2):
            if epoch:
                tp.new_epoch()
            for _ in range(2):
                _step(net)
                tp.step(samples=4, tokens=4 * 32)
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert names == ["e0.b1.bie1.s4.t128.json", "e0.b2.bie2.s8.t256.json",
                     "e1.b3.bie1.s12.t384.json", "e1.b4.bie2.s16.t512.json"]


def test_default_run_name_is_unique(tmp_path, net, monkeypatch):
    """Two runs with default settings in the same directory do not collide (the constant 'run' raised)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    folders = []
    for _ in range(2):
        with TraceProfiler(active=1) as tp:
            _step(net)
            tp.step()
        folders.append(tp.folder)
        assert any(tp.folder.glob("*.json"))
    assert folders[0] != folders[1]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    assert TraceProfiler().run_name == "run-job42"  # torchrun: every rank agrees


def test_rank_from_slurm(tmp_path, monkeypatch):
    """Without a process group, SLURM_PROCID names the files (ranks no longer overwrite each other)."""
    for v in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "6")
    tp = TraceProfiler(folder=str(tmp_path), run_name="r")
    assert tp.fmt["rank"] == 6 and tp._name(tp.filename).name == "rank6.0.pt.trace.json"
