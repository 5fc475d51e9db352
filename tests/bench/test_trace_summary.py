"""bench.trace_summary reads one profiled step's Kineto trace: GPU idle time, the copies, and where the exposed ones
land (forward or backward, their offset, the kernels around them). The GPU arithmetic is checked on a trace with
known intervals; the reading of torch's own file format on a real CPU profiler trace of an offloaded step."""

from __future__ import annotations

import copy
import gzip
import json

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench.model import ToyLlama, ToyLlamaConfig
from bench.trace_summary import format_markdown, summarize
from offload import OffloadActivations

MAIN, AUTOGRAD = 1, 2


def _x(cat: str, name: str, ts: float, dur: float, tid: int = MAIN, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def _gpu_step() -> dict:
    """A step on a device timeline (us): forward kernels K1 [0,100], K2 [150,300] with a D2H [250,400] that K2
    hides for 50 us; backward (launched inside autograd's evaluate_function on its own thread) K3 [1000,1200],
    K4 [1300,1500] with an H2D [1200,1300] between them that nothing hides."""
    ev = [_x("cpu_op", "aten::mm", 0, 50), _x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 900, 400,
                                              tid=AUTOGRAD)]
    launches = [(1, 10, MAIN), (2, 20, MAIN), (3, 30, MAIN), (4, 950, AUTOGRAD), (5, 960, AUTOGRAD), (6, 970, AUTOGRAD)]
    ev += [_x("cuda_runtime", "cudaLaunchKernel", ts, 5, tid, correlation=c) for c, ts, tid in launches]
    ev += [_x("kernel", "K1_gemm", 0, 100, 7, correlation=1), _x("kernel", "K2_gemm", 150, 150, 7, correlation=2),
           _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 250, 150, 8, correlation=3, bytes=6_000_000),
           _x("kernel", "K3_bwd", 1000, 200, 7, correlation=4),
           _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1200, 100, 9, correlation=5, bytes=4_000_000),
           _x("kernel", "K4_bwd", 1300, 200, 7, correlation=6),
           _x("user_annotation", "offload::stall", 955, 2, AUTOGRAD)]
    return {"traceEvents": ev}


def test_idle_time_and_exposed_copies_on_a_known_device_timeline():
    """Step window, forward/backward split, kernel-busy, compute-idle and GPU-idle time, and each direction's
    exposed copy time equal the intervals' arithmetic; each exposed copy is placed with its phase and neighbours."""
    s = summarize(_gpu_step())
    assert (s["step_ms"], s["forward_ms"], s["backward_ms"], s["backward_found"]) == (1.5, 1.0, 0.5, True)
    assert s["kernel_busy_ms"] == 0.65 and s["compute_idle_ms"] == 0.85 and s["gpu_idle_ms"] == 0.65
    d2h, h2d = s["copies"]["d2h"], s["copies"]["h2d"]
    assert (d2h["count"], d2h["bytes"], d2h["ms"], d2h["exposed_ms"]) == (1, 6_000_000, 0.15, 0.1)
    assert d2h["gb_s"] == 40.0 and d2h["exposed_by_phase"] == {"forward": 0.1, "backward": 0.0}
    assert (h2d["exposed_ms"], h2d["exposed_by_phase"]) == (0.1, {"forward": 0.0, "backward": 0.1})
    assert s["exposed_copy_ms"] == 0.2 and s["exposed_by_phase"] == {"forward": 0.1, "backward": 0.1}
    late = next(p for p in s["largest_exposed"] if p["phase"] == "backward")
    assert late == {"at_ms": 1.2, "ms": 0.1, "phase": "backward", "after_kernel": "K3_bwd", "before_kernel": "K4_bwd"}
    assert s["gpu_idle_by_phase"] == {"forward": 0.65, "backward": 0.0} and s["host"]["offload::stall"]["count"] == 1


def test_a_copy_hidden_under_a_kernel_is_not_exposed():
    """Moving the D2H entirely under K2 takes it out of the exposed time (and leaves the H2D's as it was)."""
    trace = _gpu_step()
    moved = copy.deepcopy(trace)
    d2h = next(e for e in moved["traceEvents"] if e["name"].startswith("Memcpy DtoH"))
    d2h["ts"], d2h["dur"] = 160, 100
    before, after = summarize(trace), summarize(moved)
    assert before["copies"]["d2h"]["exposed_ms"] > 0 and after["copies"]["d2h"]["exposed_ms"] == 0
    assert after["copies"]["h2d"] == before["copies"]["h2d"] and after["exposed_copy_ms"] == 0.1


def test_without_backward_work_everything_is_forward():
    """A trace whose launches never come from autograd's backward is all forward (no split invented)."""
    trace = _gpu_step()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not e["name"].startswith("autograd::")]
    s = summarize(trace)
    assert not s["backward_found"] and s["forward_ms"] == s["step_ms"] and s["backward_ms"] == 0
    assert s["exposed_by_phase"]["backward"] == 0


def test_a_real_cpu_profiler_trace_gives_the_host_split_and_the_engines_annotations(tmp_path):
    """torch.profiler's own export (gzipped, as the bench keeps it) of an offloaded CPU step: no device activity
    (said so), a host forward/backward split that adds up to the step, and the engine's annotations counted."""
    torch.manual_seed(0)
    model = ToyLlama(ToyLlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16))
    x = torch.randint(0, 64, (2, 16))  # (B, T)
    engine = OffloadActivations(device="cpu", min_offload_size=0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with engine:
            logits = model(x)  # (B, T, V)
        F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    raw = tmp_path / "trace.json"
    prof.export_chrome_trace(str(raw))
    gz = tmp_path / "trace.json.gz"
    gz.write_bytes(gzip.compress(raw.read_bytes()))
    s = summarize(gz)
    assert s == summarize(json.loads(raw.read_text()))
    assert s["device_events"] == 0 and "CPU run" in s["note"]
    assert 0 < s["host_forward_ms"] < s["host_step_ms"] and s["host_backward_ms"] > 0
    assert s["host_forward_ms"] + s["host_backward_ms"] == pytest.approx(s["host_step_ms"], abs=0.002)
    packs = engine.ledger.summary()["packed_count"]
    assert s["host"]["offload::pack"]["count"] == packs > 0 and s["host"]["offload::unpack"]["count"] > 0
    assert "no device activity" in format_markdown({"offload": s})


def test_the_markdown_table_prints_the_summary():
    """The results' table row carries the step, split, idle and exposed figures of the summary."""
    md = format_markdown({"offload_part": summarize(_gpu_step()), "none": {"error": "RuntimeError: boom"}})
    row = next(line for line in md.splitlines() if line.startswith("| offload_part"))
    assert "| 1.5 | 1.0 | 0.5 |" in row and "0.2 (0.1 / 0.1)" in row
    assert "none: the profiled step failed: RuntimeError: boom" in md
    assert "after `K3_bwd`, before `K4_bwd`" in md


def test_compute_waiting_on_a_launch_is_the_hosts():
    """A kernel whose launch returns after the device went idle makes the idle time up to that return the host's
    (``host_late_ms``, in its phase); a kernel launched well ahead adds none. The host's lead is launch-to-start."""
    trace = _gpu_step()
    base = summarize(trace)  # K3's launch returns at 955: the gap [300, 1000] waits on it up to then
    assert base["host_late_ms"] == 0.655 and base["host_late_by_phase"] == {"forward": 0.655, "backward": 0.0}
    late = copy.deepcopy(trace)
    k2_launch = next(e for e in late["traceEvents"] if e["cat"] == "cuda_runtime" and e["args"]["correlation"] == 2)
    k2_launch["ts"] = 120  # returns at 125, 25 us into the idle gap [100, 150] before K2
    s = summarize(late)
    assert s["host_late_ms"] == 0.68 and s["host_late_by_phase"] == {"forward": 0.68, "backward": 0.0}
    assert s["compute_idle_ms"] == base["compute_idle_ms"]  # the same gaps, now partly the host's
    assert s["host_lead_ms"]["backward"] == base["host_lead_ms"]["backward"] == 0.325  # K3 0.045, K4 1300 - 975
    assert "waiting on the host" in format_markdown({"late": s})


def test_the_h200_runs_host_wait_is_what_the_docs_say():
    """docs/gpu-run.md's host-wait figures for run C are the summary of its committed traces."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = root / "bench/results/nvidia-h200/2026-11-29-4358372"
    part = summarize(run / "trace_8b_L32_s4096_b1_bfloat16_offload_part.json.gz")
    none = summarize(run / "trace_8b_L32_s4096_b1_bfloat16_none.json.gz")
    docs = " ".join((root / "docs/gpu-run.md").read_text().split())
    p = part["host_late_by_phase"]
    assert (f"has {part['host_late_ms']:.1f} ms of compute-idle time spent waiting for the host ({p['forward']:.1f} in "
            f"the forward, {p['backward']:.1f} in the backward;") in docs
    assert (f"`none` has {none['host_late_ms']:.1f} ms, and the kernels' busy time is the same in both "
            f"({none['kernel_busy_ms']:.1f} and {part['kernel_busy_ms']:.1f} ms)") in docs
    assert (f"by a median of {none['host_lead_ms']['forward']:.0f} ms in the forward "
            f"({none['host_lead_ms']['backward']:.0f} ms in the backward); with six blocks offloaded, by "
            f"{part['host_lead_ms']['forward']:.1f} ms") in docs
    assert part["host_late_ms"] > 10 * none["host_late_ms"]
