"""Per-step totals are a bounded ring while the running totals still cover every step."""

from __future__ import annotations

import tracemalloc

import torch

from offload import OffloadActivations
from offload.ledger import KEPT, OFFLOADED, Ledger, PackRecord
from offload.streams import Copy


def _rec(seq: int, step: int, offloaded: bool) -> PackRecord:
    return PackRecord(seq, step, 100 + seq % 7, (4,), "torch.float32", "cpu", "m",
                      OFFLOADED if offloaded else KEPT, "" if offloaded else "too_small",
                      seq, 128, copy_bytes=128 if offloaded else 0)


def _run_steps(led: Ledger, first: int, n: int) -> tuple[int, int, int]:
    packed = offloaded = kept = 0
    seq = first * 3
    for step in range(first, first + n):
        for j in range(3):
            r = _rec(seq, step, offloaded=j != 0)
            seq += 1
            led.add(r, new_storage=True)
            packed += r.nbytes
            if r.decision == OFFLOADED:
                offloaded += r.nbytes
            else:
                kept += r.nbytes
        led.close_step(pool={"reserved_bytes": step, "in_use_bytes": 0, "pad": "x" * 200})
    return packed, offloaded, kept


def test_5000_steps_bounded_memory_exact_totals():
    """5,000 closed steps: step_totals keeps the last max_steps, memory stops growing, totals count all."""
    led = Ledger(max_records=100, max_steps=50)
    warm = _run_steps(led, 0, 500)  # fills both rings
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    rest = _run_steps(led, 500, 4500)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 64 * 1024, f"ledger grew by {grown} B over 4,500 steps (unbounded?)"
    assert len(led.step_totals) == 50 and len(led.records) == 100
    assert led.step_totals[-1].step == 4999 and led.step_totals[0].step == 4950
    s = led.summary()
    assert s["steps"] == 5000 == led.steps_closed
    assert s["packed_count"] == 15000 and s["offloaded_count"] == 10000 and s["kept_count"] == 5000
    assert s["packed_bytes"] == warm[0] + rest[0]
    assert s["offloaded_bytes"] == warm[1] + rest[1] and s["kept_bytes"] == warm[2] + rest[2]
    assert s["kept_by_reason"] == {"too_small": warm[2] + rest[2]}
    assert s["unique_bytes"] == 15000 * 128 and s["d2h_bytes"] == 10000 * 128
    led.reset()
    assert led.summary()["steps"] == 0 and not led.step_totals


def test_engine_step_totals_ring_and_summary_steps():
    """Through the engine: step_totals[-1] is the latest backward, summary()["steps"] counts every one."""
    ctx = OffloadActivations(device="cpu", min_offload_size=0)
    ctx.ledger.max_steps = 3
    ctx.ledger.reset()  # the ring's length is fixed when it is created
    x = torch.randn(64, requires_grad=True)
    for _ in range(7):
        with ctx:
            y = (x.sin() * x).sum()
        y.backward()
    assert len(ctx.ledger.step_totals) == 3 and ctx.ledger.step_totals[-1].step == 6
    s = ctx.ledger.summary()
    assert s["steps"] == 7
    assert s["packed_count"] == 7 * ctx.ledger.step_totals[-1].packed_count


class _LateEvent:
    """A device event that reports done once ``clock[0]`` reaches ``ready``."""

    def __init__(self, clock: list[int], ready: int) -> None:
        self.clock, self.ready, self.polls = clock, ready, 0

    def query(self) -> bool:
        self.polls += 1
        return self.clock[0] >= self.ready

    def synchronize(self) -> None:
        self.clock[0] = max(self.clock[0], self.ready)

    def elapsed_time(self, other: "_LateEvent") -> float:
        return 1.0  # ms


def test_pending_copies_polled_in_order_not_rescanned():
    """With hundreds of copies in flight, each new copy polls O(1) events; every time lands once resolved."""
    led = Ledger()
    clock = [0]
    events = []
    for i in range(500):
        done = _LateEvent(clock, ready=10**9)  # nothing finishes while we issue
        events.append(done)
        led.add_copy_time(None, "d2h", Copy(done, None, _LateEvent(clock, 0)))
    polls = sum(e.polls for e in events)
    assert polls < 2 * 500, f"{polls} polls for 500 copies: pending copies are re-scanned"
    assert led.totals().d2h_seconds == 0.0
    clock[0] = 10**9
    t = led.totals()
    assert abs(t.d2h_seconds - 0.5) < 1e-9  # 500 x 1 ms, each counted exactly once
    assert led.totals().d2h_seconds == t.d2h_seconds
