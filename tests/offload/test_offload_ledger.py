"""The ledger accounts for every pack decision: records, per-step totals, summary, JSON, observers."""

from __future__ import annotations

import json

import pytest
import torch

from offload import (
    OffloadActivations,
    REASONS,
    PackEvent,
    PackRecord,
    active_engine,
    add_pack_observer,
    current_module_name,
    track_modules,
)
from offload_testkit import (
    assert_reconciles,
    cpu_ctx,
    make_inputs,
    make_model,
    run_step,
)

SUMMARY_KEYS = {
    "packed_bytes", "packed_count", "offloaded_bytes", "offloaded_count", "kept_bytes", "kept_count",
    "kept_by_reason", "kept_count_by_reason", "unique_bytes", "d2h_bytes", "d2h_seconds", "h2d_bytes",
    "h2d_seconds", "stall_seconds", "peak_inflight_bytes", "steps", "pool",
}
POOL_KEYS = {"reserved_bytes", "in_use_bytes", "peak_reserved_bytes", "allocations", "reuses",
             "pin_failures", "evictions", "capacity_bytes"}


def _toy_steps(n: int, **kw):
    model = make_model("toy")
    ctx = cpu_ctx(**kw)
    for i in range(n):
        run_step(model, make_inputs("toy", seed=i), ctx)
    return ctx


def test_summary_has_contract_keys_and_reconciles():
    """summary() has every contract key; packed = offloaded + kept; kept_by_reason sums to kept."""
    ctx = _toy_steps(2, min_offload_size=1024)
    s = ctx.ledger.summary()
    assert SUMMARY_KEYS <= set(s), SUMMARY_KEYS - set(s)
    assert POOL_KEYS <= set(s["pool"]), POOL_KEYS - set(s["pool"])
    assert_reconciles(s)
    assert set(s["kept_by_reason"]) <= set(REASONS), s["kept_by_reason"]
    assert s["offloaded_count"] > 0 and s["kept_count"] > 0
    assert s["steps"] == 2
    assert s["d2h_bytes"] >= s["offloaded_bytes"] > 0
    assert s["h2d_bytes"] > 0, "backward reloaded nothing"
    assert s["d2h_seconds"] >= 0 and s["h2d_seconds"] >= 0 and s["stall_seconds"] >= 0


def test_records_match_totals():
    """Per-decision records add up to the summary's totals (nothing dropped below the ring size)."""
    ctx = _toy_steps(2)
    s = ctx.ledger.summary()
    recs = list(ctx.ledger.records)
    assert len(recs) == s["packed_count"]
    assert sum(r.nbytes for r in recs) == s["packed_bytes"]
    assert sum(r.nbytes for r in recs if r.decision == "offloaded") == s["offloaded_bytes"]
    for r in recs:
        assert isinstance(r, PackRecord)
        assert r.decision in ("offloaded", "kept")
        assert (r.reason == "") == (r.decision == "offloaded"), r
        assert r.reason == "" or r.reason in REASONS
        assert r.nbytes == torch.Size(r.shape).numel() * torch.empty(0, dtype=getattr(torch, r.dtype.split(".")[-1])).element_size()
        assert r.device == "cpu"
    assert [r.seq for r in recs] == sorted(r.seq for r in recs)
    assert {r.step for r in recs} == {0, 1}
    # Each copy counted once: the records' copy bytes are the D2H bytes, and every one went to a tier.
    assert sum(r.copy_bytes for r in recs) == s["d2h_bytes"] == sum(t["bytes"] for t in s["tiers"].values())


def test_d2h_bytes_count_each_copy_once_with_or_without_a_tier():
    """A copy is counted in D2H bytes once: through its tier's log, or (a record added by hand that
    names no tier) on its own; never in both."""
    from offload.ledger import Ledger

    led = Ledger()
    led.add(PackRecord(0, 0, 100, (25,), "torch.float32", "cpu", "m", "offloaded", "", copy_bytes=128, tier="pool"))
    led.add(PackRecord(1, 0, 100, (25,), "torch.float32", "cpu", "m", "offloaded", "", copy_bytes=64))
    led.close_step()
    s = led.summary()
    assert s["d2h_bytes"] == 192 and s["offloaded_bytes"] == 200
    assert s["tiers"]["pool"]["bytes"] == 128 and sum(t["bytes"] for t in s["tiers"].values()) == 128


def test_step_totals_one_per_backward():
    """ledger.step_totals has one entry per backward pass, and they sum to the summary."""
    ctx = _toy_steps(3)
    st = ctx.ledger.step_totals
    assert len(st) == 3
    s = ctx.ledger.summary()
    for key in ("packed_count", "packed_bytes", "offloaded_bytes", "kept_bytes"):
        assert sum(getattr(t, key) for t in st) == s[key], key
    assert st[0].packed_count == st[1].packed_count == st[2].packed_count


def test_step_closes_even_when_every_tensor_is_kept():
    """A backward through a graph whose saves were all kept still closes a ledger step."""
    model = make_model("mlp")
    ctx = cpu_ctx(min_offload_size=1 << 30)
    for i in range(2):
        run_step(model, make_inputs("mlp", seed=i), ctx)
    s = ctx.ledger.summary()
    assert s["offloaded_count"] == 0 and s["kept_count"] > 0
    assert s["steps"] == 2, f"steps={s['steps']}: a step closes at the end of each backward that used the engine"


def test_json_export_round_trips(tmp_path):
    """to_json() is valid JSON carrying the summary; writing to a path gives the same text."""
    ctx = _toy_steps(1)
    text = ctx.ledger.to_json()
    data = json.loads(text)
    s = ctx.ledger.summary()
    flat = json.dumps(data)
    assert str(s["offloaded_bytes"]) in flat and str(s["packed_count"]) in flat
    summary = data.get("summary", data)
    assert summary["offloaded_bytes"] == s["offloaded_bytes"]
    assert summary["kept_by_reason"] == s["kept_by_reason"]
    p = tmp_path / "ledger.json"
    text2 = ctx.ledger.to_json(str(p))
    assert json.loads(p.read_text()) == json.loads(text2)


def test_reset_clears_totals_but_not_pool():
    """ledger.reset() forgets records and totals; the engine keeps working and counting afresh."""
    ctx = _toy_steps(2)
    reserved = ctx.pool.stats()["reserved_bytes"]
    ctx.ledger.reset()
    s = ctx.ledger.summary()
    assert s["packed_count"] == 0 and s["steps"] == 0 and len(ctx.ledger.records) == 0
    assert ctx.pool.stats()["reserved_bytes"] == reserved
    run_step(make_model("toy"), make_inputs("toy"), ctx)
    assert ctx.ledger.summary()["steps"] == 1


def test_records_ring_is_bounded_but_totals_are_not():
    """With max_records small the record ring is bounded while the totals still count every pack."""
    ctx = _toy_steps(3, max_records=10)
    s = ctx.ledger.summary()
    assert len(ctx.ledger.records) == 10
    assert s["packed_count"] > 10
    assert_reconciles(s)


def test_records_name_the_module():
    """Records carry the qualified module name of the forward that saved them."""
    ctx = _toy_steps(1)
    mods = {r.module for r in ctx.ledger.records}
    assert any(m.endswith("layers.0.attn.wqkv") for m in mods), sorted(mods)
    assert any(m.endswith("layers.1.mlp.w2") for m in mods), sorted(mods)
    assert all(m.startswith("ToyLlama") for m in mods if m), sorted(mods)


def test_observers_see_every_pack_and_remove():
    """ctx.add_observer and add_pack_observer see each pack once with its record; remove() stops them."""
    model = make_model("mlp")
    ctx = cpu_ctx()
    mine, glob = [], []
    h1 = ctx.add_observer(mine.append)
    h2 = add_pack_observer(glob.append)
    try:
        run_step(model, make_inputs("mlp"), ctx)
    finally:
        h2.remove()
    n = ctx.ledger.summary()["packed_count"]
    assert len(mine) == len(glob) == n > 0
    for ev in mine:
        assert isinstance(ev, PackEvent)
        assert ev.engine is ctx and isinstance(ev.tensor, torch.Tensor)
    assert [e.record.seq for e in mine] == [r.seq for r in ctx.ledger.records]
    h1.remove()
    run_step(model, make_inputs("mlp"), ctx)
    assert len(mine) == len(glob) == n


def test_active_engine_is_innermost():
    """active_engine() is the innermost entered engine on this thread, None outside."""
    a, b = cpu_ctx(), cpu_ctx()
    assert active_engine() is None
    with a:
        assert active_engine() is a
        with b:
            assert active_engine() is b
        assert active_engine() is a
    assert active_engine() is None


def test_track_modules_current_module_name():
    """track_modules() + current_module_name() give the running module's qualified name."""
    model = make_model("mlp")
    seen = []
    model.fc2.register_forward_pre_hook(lambda m, a: seen.append(current_module_name()))
    with track_modules():
        model(make_inputs("mlp")[0])
        assert current_module_name() == ""
    assert seen and seen[0].endswith("fc2"), seen


def test_step_totals_carry_pool_and_rss():
    """Each closed step snapshots the pool stats and the host RSS."""
    ctx = _toy_steps(2)
    for t in ctx.ledger.step_totals:
        assert POOL_KEYS <= set(t.pool)
        assert t.host_rss_bytes is None or t.host_rss_bytes > 0


@pytest.mark.parametrize("min_offload_size", [0, 1 << 40], ids=["offloaded", "kept"])
def test_unique_bytes_count_a_new_storage_at_a_dead_savers_address(min_offload_size):
    """Two storages at one address in one step (the first and its saver dead before the second is
    saved: an allocator's reuse, made certain here with two tensors over one buffer) are two sets of
    saved bytes; while the first saver lives, a second save of its bytes adds none."""
    import gc

    buf = bytearray(4096 * 4)
    w = torch.randn(4096, 1, requires_grad=True)
    ctx = OffloadActivations(device="cpu", min_offload_size=min_offload_size)
    with ctx:
        first = torch.frombuffer(buf, dtype=torch.float32)
        y = (first @ w).sum()  # saves `first`
        again = (first @ w).sum()  # the same storage, its saver alive: nothing new
        del y, again, first
        gc.collect()
        second = torch.frombuffer(buf, dtype=torch.float32)  # a new storage, at the same address
        z = (second @ w).sum()
    assert second.untyped_storage().data_ptr() == torch.frombuffer(buf, dtype=torch.float32).data_ptr()
    z.backward()
    assert ctx.ledger.summary()["unique_bytes"] == 2 * 4096 * 4


@pytest.mark.parametrize("min_offload_size", [0, 1 << 40], ids=["offloaded", "kept"])
def test_unique_bytes_count_the_saved_span_as_the_tracker_does(min_offload_size):
    """A saved batch slice adds only the bytes it spans to unique_bytes, as PackedBytesTracker counts."""
    from offload.profiling import PackedBytesTracker

    data = torch.randn(1000, 640)  # 2.5 MB storage
    w = torch.randn(640, 2, requires_grad=True)
    w2 = torch.randn(2, 2, requires_grad=True)
    ctx = OffloadActivations(device="cpu", min_offload_size=min_offload_size)
    with ctx, PackedBytesTracker() as tracker:
        a = data[:4] @ w  # saves data[:4]: 4 rows
        b = data[2:6] @ w  # overlaps rows 2..3: adds rows 4..5 only
        c = data[8:10, :2] @ w2  # not contiguous: spans row 8 and the first 2 elements of row 9
    (a.sum() + b.sum() + c.sum()).backward()
    row = 640 * 4
    led = ctx.ledger.summary()
    assert led["unique_bytes"] == 6 * row + (640 + 2) * 4, led["unique_bytes"]
    assert led["unique_bytes"] == tracker.summary()["unique_bytes"]
    assert led["unique_bytes"] < data.untyped_storage().nbytes()
    # The grads are those of plain autograd.
    ref_w, ref_w2 = w.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    ((data[:4] @ ref_w).sum() + (data[2:6] @ ref_w).sum() + (data[8:10, :2] @ ref_w2).sum()).backward()
    assert torch.equal(w.grad, ref_w.grad) and torch.equal(w2.grad, ref_w2.grad)
