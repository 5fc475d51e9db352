"""The simulated timeline (offload.predict._timeline): its semantics on hand-made traces, closed forms
exact to the nanosecond, stall labels, memory, the Chrome trace."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from offload.predict import GPUS
from offload.predict._cost import HostCost, kernel_seconds
from offload.predict._timeline import simulate
from offload.predict._trace import (Alloc, Copy, Free, HostSync, HostWork, Kernel, RecordEvent, RecordStream, Trace,
                                    WaitEvent)

US = 1e-6
H100 = GPUS["h100-sxm"]
NO_HOST = HostCost(op_s=0.0, event_s=0.0, work_s={})


def units(item, gpu):
    """Kernels take 10 us; a copy nbytes / link rate (no latency)."""
    if type(item) is Kernel:
        return 10 * US
    if type(item) is Copy:
        return item.nbytes / (gpu.d2h_bytes_per_s if item.direction == "d2h" else gpu.h2d_bytes_per_s)
    return 0.0


def at(rate):
    return dataclasses.replace(H100, d2h_bytes_per_s=rate, h2d_bytes_per_s=rate)


def k(stream=0, **kw):
    return Kernel(stream, "aten.mm.default", 0, 0, torch.bfloat16, **kw)


def trace(*items):
    t = Trace()
    for it in items:
        t.append(it)
    return t


def offload_chain(nbytes):
    """K1, a D2H of its output on stream 1 (ordered after K1), K2, K3, then compute waits for the copy, K4."""
    return trace(k(), RecordEvent(0, 1), WaitEvent(1, 1, "order"), Copy(1, "d2h", nbytes, True), RecordEvent(1, 2),
                 k(), k(), WaitEvent(0, 2, "free"), k())


# -- closed forms -------------------------------------------------------------------------------

def test_matmul_chain_is_the_closed_form_roofline():
    """A chain of bf16 matmuls of known FLOPs on an H100: step = first issue + the sum of roofline times."""
    m = n = kk = 4096
    flops, nbytes = 2 * m * n * kk, 2 * (m * kk + kk * n + m * n)
    ops = [Kernel(0, "aten.mm.default", flops, nbytes, torch.bfloat16) for _ in range(6)]
    host = HostCost(op_s=5 * US, event_s=0.0, work_s={})
    res = simulate(trace(*ops), H100, host_cost=host)
    each = flops / (989e12 * (794.5 / 989)) + H100.launch_s  # compute-bound at this size
    assert kernel_seconds(ops[0], H100) == pytest.approx(each, rel=1e-12)
    assert round(res.step_seconds * 1e9) == 5_000 + 6 * round(each * 1e9)
    assert res.kernel_seconds == pytest.approx(6 * each, abs=6e-9)


@pytest.mark.parametrize("copy_us", [5, 20, 35])
def test_copy_behind_compute_is_the_closed_form(copy_us):
    """A D2H issued after K1 and awaited before K4: step = K1 + max(K2 + K3, copy) + K4, and exposed copy
    time = max(0, copy - K2 - K3), to the nanosecond."""
    nbytes = 1_000_000
    gpu = at(nbytes / (copy_us * US))
    res = simulate(offload_chain(nbytes), gpu, host_cost=NO_HOST, device_cost=units)
    assert round(res.step_seconds * 1e9) == 10_000 + max(20_000, copy_us * 1000) + 10_000
    assert round(res.exposed_copy_seconds * 1e9) == max(0, copy_us * 1000 - 20_000)


def test_link_rate_needed_is_the_rate_that_just_hides_the_copy():
    """link_bytes_per_s_needed: the copy must fit behind K2 + K3 (20 us): nbytes / 20 us."""
    nbytes = 1_000_000
    res = simulate(offload_chain(nbytes), at(1e9), host_cost=NO_HOST, device_cost=units)
    assert res.exposed_copy_seconds > 0
    assert res.link_bytes_per_s_needed == pytest.approx(nbytes / (20 * US), rel=2e-3)
    assert simulate(trace(k()), H100).link_bytes_per_s_needed == 0.0  # no copies, nothing needed


def test_link_rate_needed_leaves_out_a_copy_awaited_as_soon_as_issued():
    """A reload awaited at issue stalls at any link rate (its latency): it is the floor, not a reason for
    ``inf``; the rate needed is the one that hides the copy that can hide (behind K2 + K3 less latency)."""
    nbytes, latency = 1_000_000, 1 * US

    def with_latency(item, gpu):
        return units(item, gpu) + (latency if type(item) is Copy else 0.0)

    t = offload_chain(nbytes)
    for it in (RecordEvent(0, 4), WaitEvent(2, 4, "order"), Copy(2, "h2d", nbytes, True), RecordEvent(2, 3),
               WaitEvent(0, 3, "use"), k()):  # a reload issued after K4 and awaited at once
        t.append(it)
    res = simulate(t, at(1e9), host_cost=NO_HOST, device_cost=with_latency)
    assert res.link_bytes_per_s_needed == pytest.approx(nbytes / (20 * US - latency), rel=2e-3)
    assert res.exposed_copy_floor_seconds == pytest.approx(latency, abs=2e-9)
    assert res.exposed_at_issue_seconds == pytest.approx(latency + nbytes / 1e9, abs=2e-9)  # at 1 GB/s
    assert res.exposed_copy_seconds - res.exposed_at_issue_seconds == pytest.approx(
        latency + nbytes / 1e9 - 20 * US, abs=2e-9)  # the copy that can hide, not yet hidden
    hidden = simulate(t, at(res.link_bytes_per_s_needed), host_cost=NO_HOST, device_cost=with_latency)
    assert hidden.exposed_copy_seconds == pytest.approx(hidden.exposed_copy_floor_seconds + nbytes
                                                        / res.link_bytes_per_s_needed, abs=2e-9)


# -- semantics ----------------------------------------------------------------------------------

def test_same_direction_copies_serialise_and_directions_overlap():
    """Two D2H on two streams take twice as long as one; a D2H and an H2D run side by side."""
    gpu = at(1e9)  # 10_000 bytes = 10 us
    same = simulate(trace(Copy(1, "d2h", 10_000, True), Copy(2, "d2h", 10_000, True)), gpu,
                    host_cost=NO_HOST, device_cost=units)
    both = simulate(trace(Copy(1, "d2h", 10_000, True), Copy(2, "h2d", 10_000, True)), gpu,
                    host_cost=NO_HOST, device_cost=units)
    assert round(same.step_seconds * 1e9) == 20_000
    assert round(both.step_seconds * 1e9) == 10_000


def test_copy_engine_serves_copies_in_the_order_they_became_ready():
    """A copy issued first but held back by a wait does not block a later copy that is ready (the engine
    serves readiness order, not issue order)."""
    t = trace(k(), RecordEvent(0, 1), WaitEvent(1, 1), Copy(1, "d2h", 10_000, True), Copy(2, "d2h", 10_000, True))
    res = simulate(t, at(1e9), host_cost=NO_HOST, device_cost=units)
    s = res._sim
    assert s.start[4] == 0 and s.end[4] == 10_000  # the later, ready copy first
    assert s.start[3] == 10_000  # the held-back one after K1 and the engine


def test_a_stream_runs_in_order_and_waits_on_the_latest_record_before_the_wait():
    """A wait binds to the event's latest record issued before it; a wait on an unrecorded event is a no-op."""
    t = trace(k(), RecordEvent(0, 1), k(), RecordEvent(0, 1), WaitEvent(1, 1), Copy(1, "d2h", 10, True),
              WaitEvent(2, 9), Copy(2, "h2d", 10, True))
    res = simulate(t, H100, host_cost=NO_HOST, device_cost=units)
    s = res._sim
    assert s.start[5] == 20_000  # after the second record (end of the second kernel), not the first
    assert s.start[7] == 0  # stream 2's wait on event 9 (never recorded) is a no-op


def test_host_sync_blocks_the_host_and_shows_as_a_host_block():
    """A HostSync blocks the host until its target's work is done; the idle it causes is a 'host block'."""
    t = trace(k(), HostSync("item", None, "loss.item()"), k())
    host = HostCost(op_s=1 * US, event_s=0.0, work_s={})
    res = simulate(t, H100, host_cost=host, device_cost=units)
    assert round(res.host_blocked_seconds * 1e9) == 10_000  # until K1 ended at 11 us
    assert round(res.step_seconds * 1e9) == 1_000 + 10_000 + 1_000 + 10_000
    assert [s.cause for s in res.stalls] == ["late issue", "host block"]


def test_pageable_copy_blocks_the_host():
    """A pageable copy runs at the pageable fraction of the link rate and the host waits for it."""
    t = trace(Copy(1, "h2d", 10_000, False), HostWork(0.0, "next"), k())
    res = simulate(t, at(1e9), host_cost=NO_HOST)
    copy_ns = round((H100.copy_latency_s + 10_000 / (1e9 * H100.pageable_fraction)) * 1e9)
    assert round(res.host_blocked_seconds * 1e9) == copy_ns
    assert res._sim.issue[2] == copy_ns


def test_bad_durations_and_sync_kinds_are_refused_by_name():
    with pytest.raises(ValueError, match="duration"):
        simulate(trace(k()), H100, device_cost=lambda it, g: -1.0)
    with pytest.raises(ValueError, match="HostSync.kind"):
        simulate(trace(HostSync("everything")), H100)
    with pytest.raises(ValueError, match="HostCost.op_s"):
        HostCost(op_s=-1.0)


# -- stalls -------------------------------------------------------------------------------------

def test_stall_causes_name_what_held_the_stream():
    """A reload issued at its point of use is a 'late issue'; one queued behind another copy on its engine
    is 'copy-engine queueing'; a reload waited before anything reads it is an 'early wait'."""
    gpu = at(1e9)
    late = trace(k(), RecordEvent(0, 1), WaitEvent(1, 1), Copy(1, "h2d", 5_000, True, blocks=(7,)),
                 RecordEvent(1, 2), WaitEvent(0, 2, "use"), k(blocks=(7,)))
    res = simulate(late, gpu, host_cost=NO_HOST, device_cost=units)
    assert [(s.cause, s.ns) for s in res.stalls if s.copy >= 0] == [("late issue", 5_000)]
    queued = trace(Copy(2, "h2d", 20_000, True), Copy(1, "h2d", 5_000, True, blocks=(7,)), RecordEvent(1, 2),
                   k(), WaitEvent(0, 2, "use"), k(blocks=(7,)))
    res = simulate(queued, gpu, host_cost=NO_HOST, device_cost=units)
    assert [(s.cause, s.ns) for s in res.stalls if s.copy >= 0] == [("copy-engine queueing", 15_000)]
    early = trace(k(), RecordEvent(0, 1), WaitEvent(1, 1), Copy(1, "h2d", 5_000, True, blocks=(7,)),
                  RecordEvent(1, 2), WaitEvent(0, 2, "use"), k(), WaitEvent(0, 3, "use"), k(blocks=(7,)))
    res = simulate(early, gpu, host_cost=NO_HOST, device_cost=units)
    assert [s.cause for s in res.stalls if s.copy >= 0] == ["early wait"]


# -- memory -------------------------------------------------------------------------------------

def test_free_is_effective_when_the_recorded_streams_are_done():
    """A block freed on its own stream is reusable at once (stream-ordered); one also used on another
    stream (record_stream) counts until that stream's queued work is done."""
    t = trace(Alloc(1, 1000, 0, "activation"), Alloc(2, 500, 0, "copy"), RecordStream(2, 1),
              k(stream=1), Free(2), Free(1), Alloc(3, 1000, 0, "activation"))
    res = simulate(t, H100, host_cost=NO_HOST, device_cost=units)
    assert res.memory_ns() == [(0, 1500), (10_000, 1000)]  # block 2 held until stream 1's kernel ended
    assert res.peak_memory_bytes == 1500


def test_chrome_trace_has_host_streams_stalls_and_memory(tmp_path):
    """write_trace: valid Chrome trace JSON with a thread per stream, a slice per kernel and copy, the
    stalls, a memory counter, and the label 'predicted' with the spec."""
    res = simulate(offload_chain(1_000_000), at(1e10), host_cost=HostCost(op_s=1 * US, event_s=0.0, work_s={}),
                   device_cost=units)
    path = tmp_path / "step.json"
    res.write_trace(str(path))
    doc = json.loads(path.read_text())
    ev = doc["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "stream 1", "issue"} <= names
    slices = [e for e in ev if e["ph"] == "X"]
    assert sum(e["name"] == "aten.mm.default" for e in slices) == 4
    assert sum(e["name"].startswith("d2h") for e in slices) == 1
    assert any(e["name"].startswith("stall: ") for e in slices)
    assert any(e["ph"] == "C" for e in ev)
    assert doc["metadata"]["predicted"] is True and doc["metadata"]["gpu"] == "h100-sxm"
    assert res.summary()["predicted"] is True
