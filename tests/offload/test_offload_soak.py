"""200 training steps of the toy model: nothing leaks (pool, host allocations, process RSS)."""

from __future__ import annotations

import gc

import psutil
import torch

from offload_testkit import cpu_ctx, make_inputs, make_model, run_step

STEPS = 200
RSS_SLACK_BYTES = 64 << 20
"""Allowed RSS growth between step 20 and step 200 (allocator noise; a leak of the
toy's ~0.2 MiB of activations per step would be ~36 MiB+ and a host-copy leak more)."""


def test_200_steps_pool_flat_and_rss_bounded():
    """200 steps: pool in-use 0 after every backward, reserved and allocations flat after step 1, RSS bounded."""
    model = make_model("toy")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ctx = cpu_ctx()
    inputs = make_inputs("toy")
    proc = psutil.Process()
    after_first = None
    rss_early = None
    for step in range(STEPS):
        run_step(model, inputs, ctx)
        opt.step()
        opt.zero_grad(set_to_none=True)
        st = ctx.pool.stats()
        assert st["in_use_bytes"] == 0, f"step {step}: {st['in_use_bytes']} B of host copies outlived backward"
        if step == 0:
            after_first = (st["reserved_bytes"], st["allocations"])
            assert st["reserved_bytes"] > 0
        else:
            assert (st["reserved_bytes"], st["allocations"]) == after_first, (
                f"step {step}: reserved/allocations {st['reserved_bytes']}/{st['allocations']} "
                f"!= {after_first} after step 1 (a static-shape loop must only reuse host buffers)"
            )
        if step == 19:
            gc.collect()
            rss_early = proc.memory_info().rss
    gc.collect()
    rss_late = proc.memory_info().rss
    grow = rss_late - rss_early
    print(f"RSS at step 20: {rss_early / 2**20:.1f} MiB, at step {STEPS}: {rss_late / 2**20:.1f} MiB, "
          f"growth {grow / 2**20:+.1f} MiB")
    assert grow < RSS_SLACK_BYTES, f"RSS grew {grow / 2**20:.1f} MiB over {STEPS - 20} steps"
    s = ctx.ledger.summary()
    assert s["steps"] == STEPS
    assert s["pool"]["reuses"] > 0
    per_step = ctx.ledger.step_totals[0].packed_count
    assert s["packed_count"] == STEPS * per_step, "totals lost counts"
    assert len(ctx.ledger.step_totals) == STEPS


def test_dynamic_shapes_host_pool_stays_bounded():
    """With 30 distinct sequence lengths the host pool reserves at most 2x its peak in-use bytes."""
    # DESIGN: host footprint <= 1.05x peak offloaded bytes. An exact-size cache that never evicts
    # keeps one set of buffers per shape ever seen, so dynamic padding grows host RAM without bound.
    from bench.model import make_batch
    from offload_testkit import TINY

    model = make_model("toy")
    ctx = cpu_ctx()
    for i in range(30):
        run_step(model, make_batch(TINY, 2, 8 + i, seed=i), ctx)
        assert ctx.pool.stats()["in_use_bytes"] == 0
    st = ctx.pool.stats()
    ratio = st["reserved_bytes"] / st["peak_in_use_bytes"]
    print(f"reserved {st['reserved_bytes']} B, peak in use {st['peak_in_use_bytes']} B, ratio {ratio:.1f}")
    assert ratio <= 2.0, f"host pool keeps {ratio:.1f}x its peak in-use bytes after 30 shapes: {st}"
