"""GPU checks (marked ``gpu``; skipped without CUDA): CUDA stats, allocator history, FSDP2 on one GPU, estimators.

Run on a GPU machine from the repo root: ``PYTHONPATH=. pytest -m gpu tests/profiling``.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import yaml

from bench.model import ToyLlama, ToyLlamaConfig, make_batch
from offload import OffloadActivations
from offload.profiling import (
    MemProfiler,
    MemProfilerCfg,
    MemProfilerFuncs,
    MemProfilerSchedule,
    ModuleMemoryStats,
    PackedBytesTracker,
    estimate_module_runtimes,
    estimate_sac,
)

pytestmark = pytest.mark.gpu


def _toy(device: str = "cuda") -> tuple[ToyLlama, torch.Tensor]:
    model = ToyLlama(ToyLlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=2)).to(device)
    tokens, _ = make_batch(model.cfg, 2, 64, device=device)
    return model, tokens


def _step(model: ToyLlama, tokens: torch.Tensor, engine: OffloadActivations | None = None) -> None:
    if engine is None:
        loss = model(tokens).float().pow(2).mean()
    else:
        with engine:
            logits = model(tokens)
        loss = logits.float().pow(2).mean()
    loss.backward()


def test_cuda_memory_stats_and_engine_totals(tmp_path):
    """CUDA allocator stats (peaks reset per call), pinned-host stats and ledger totals land in the entries."""
    model, tokens = _toy()
    engine = OffloadActivations()  # the current accelerator
    cfg = MemProfilerCfg(enabled=True, save_dir=tmp_path, collect_funcs=MemProfilerFuncs(cuda={"training_step"}))
    prof = MemProfiler(cfg, model, engine=engine)
    for _ in range(3):
        with prof.profile("training_step"):
            _step(model, tokens, engine)
    data = yaml.safe_load((tmp_path / "rank_0_memory_stats.yaml").read_text())
    start, end = data["0.training_step.2.start"], data["0.training_step.2.end"]
    assert start["allocated_bytes.all.peak"] == start["allocated_bytes.all.current"]  # peak reset at start
    assert end["allocated_bytes.all.peak"] > start["allocated_bytes.all.current"]
    assert end["num_ooms"] == 0
    assert any(k.startswith("host.") for k in end), sorted(end)[:20]
    assert end["offload.offloaded_bytes"] > 0 and end["npp_diff"] > 0


def _sizes(snap: dict) -> set[int]:
    return {e.get("size") for t in snap["device_traces"] for e in t if e.get("action") == "alloc"}


def _odd(nbytes: int) -> set[int]:
    return {nbytes, -(-nbytes // 512) * 512}  # as requested, and as the allocator rounds it


def test_allocator_history_pickles_are_bounded_readable_and_stopped(tmp_path):
    """Start/end pickles are read by torch.cuda._memory_viz; the ring is bounded; recording stops when done."""
    from torch.cuda import _memory_viz

    model, tokens = _toy()
    max_entries = 500
    cfg = MemProfilerCfg(enabled=True, save_dir=tmp_path, cuda_allocator_history=True,
                         cuda_allocator_history_max_entries=max_entries,
                         collect_funcs=MemProfilerFuncs(cuda_allocator_history={"training_step"}))
    prof = MemProfiler(cfg, model)
    keep = []
    for i in range(2):
        with prof.profile("training_step"):
            _step(model, tokens)
            if i == 1:
                keep.append(torch.empty(123457, dtype=torch.uint8, device="cuda"))  # recorded
    for ctx in ("start", "end"):
        path = tmp_path / f"cuda_alloc_rank_0.training_step.2.{ctx}.pickle"
        with open(path, "rb") as f:
            snap = pickle.load(f)
        assert "segments" in snap and "device_traces" in snap
        assert all(len(t) <= max_entries for t in snap["device_traces"])
        assert isinstance(_memory_viz.segsum(snap), str)
        assert isinstance(_memory_viz.trace(snap), str)
    with open(tmp_path / "cuda_alloc_rank_0.training_step.2.end.pickle", "rb") as f:
        assert _sizes(pickle.load(f)) & _odd(123457)  # positive control: recording was on
    keep.append(torch.empty(234567, dtype=torch.uint8, device="cuda"))  # after the window closed
    assert not _sizes(torch.cuda.memory._snapshot()) & _odd(234567)


def test_tracker_and_engine_on_cuda():
    """On CUDA the tracker observes the engine's packs (both orders) and offloading still happens."""
    model, tokens = _toy()
    for inside in (True, False):
        engine, tracker = OffloadActivations(), PackedBytesTracker()
        if inside:
            with engine, tracker:
                logits = model(tokens)
        else:
            with tracker, engine:
                logits = model(tokens)
        logits.float().pow(2).mean().backward()
        led = engine.ledger.summary()
        assert led["offloaded_bytes"] > 0
        assert tracker.summary()["packed_bytes"] == led["packed_bytes"]


def test_fsdp2_mem_tracker_on_one_gpu(tmp_path):
    """FSDPMemTracker report from a one-GPU nccl fully_shard run (subprocess)."""
    from test_prof_fsdp import run_worker

    res = run_worker(tmp_path, "cuda")
    assert "fsdp_mem_rank_0_training_step_2.log" in res["files"]
    log = (tmp_path / "fsdp_mem_rank_0_training_step_2.log").read_text()
    assert "Sharded Param" in log and "Device: cuda" in log
    sharded = [v for k, v in res["fsdp_peak"].items() if k.endswith(".sharded_param")]
    assert sharded and sharded[0] >= res["param_bytes"]  # CUDA storages round up to 512 B


def test_module_stats_on_cuda():
    """MemTracker stats on CUDA: the root is first and activations and the peak are non-zero."""
    model, tokens = _toy()
    stats = ModuleMemoryStats(model)
    with stats:
        _step(model, tokens)
    rows = stats.modules()
    assert rows[0]["fqn"] == "ToyLlama" and rows[0]["act_total_bytes"] > 0
    assert stats.peak()["Total"] > 0


def test_estimators_on_cuda():
    """RuntimeEstimator and SACEstimator run behind the CUDA guard and report ToyLlama's modules."""

    def setup():
        # Built on the device: under FakeTensorMode, Module.cuda() swaps tensors, and torch 2.11 refuses
        # the swap because the fake mode holds weak references to them (found on an H200, 2026-11-26).
        with torch.device("cuda"):
            model = ToyLlama(ToyLlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=2))
        tokens, _ = make_batch(model.cfg, 2, 64, device="cuda")
        return model, tokens

    def step(state):
        model, tokens = state
        model(tokens).float().pow(2).mean().backward()

    rt = estimate_module_runtimes(setup, step)
    assert "ToyLlama" in rt and rt["ToyLlama"]["fw_ms"] >= 0
    sac = estimate_sac(setup, step)
    assert any(k.startswith("ToyLlama") for k in sac)
    assert all(v["num_ops"] >= 0 for v in sac.values())


def test_schedule_default_on_cuda_collects_cuda_by_default(tmp_path):
    """On a CUDA host the merged defaults collect CUDA stats for training_step without extra config."""
    model, tokens = _toy()
    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path,
                                      schedule=MemProfilerSchedule(warmup_iters=0, max_iter=1)), model)
    with prof.profile("training_step"):
        _step(model, tokens)
    assert "allocated_bytes.all.current" in prof.memory_stats["0.training_step.1.end"]
