"""PackedBytesTracker: exact byte counts, steps, and coexistence with the offload engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload import OffloadActivations
from offload.profiling import PackedBytesTracker, ProfilingError

from _prof_models import F32, MLP


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_hand_computed_views_and_repeats():
    """Views count once in unique bytes, repeated saves twice in logical, Parameters not at all."""
    x = torch.randn(4, 8, requires_grad=True)
    w = nn.Parameter(torch.randn(8, 16))
    with PackedBytesTracker() as t:
        y = x @ w  # saves x (128 B) and w (the Parameter: static, 512 B)
        z = y.sin()  # saves y (256 B)
        q = y[:, :8]  # a view of y's storage
        r = q * q  # saves q twice (128 B each, storage already counted)
    (z.sum() + r.sum()).backward()
    s = t.summary()
    assert s["logical_bytes"] == 128 + 256 + 128 + 128
    assert s["logical_count"] == 4
    assert s["unique_bytes"] == 128 + 256
    assert s["unique_count"] == 2
    assert s["static_bytes"] == 8 * 16 * F32
    assert s["packed_bytes"] == s["logical_bytes"] + s["static_bytes"]
    assert s["via_engine_bytes"] == 0


def test_weight_transpose_is_excluded(mlp):
    """nn.Linear saves weight.t(), a view of a Parameter: counted as static, never as npp."""
    with PackedBytesTracker() as t:
        mlp(MLP.batch()).sum().backward()
    s = t.summary()
    assert s["logical_bytes"] == MLP.LOGICAL
    assert s["unique_bytes"] == MLP.UNIQUE
    assert s["static_bytes"] == MLP.STATIC
    assert {k: v["logical_bytes"] for k, v in s["modules"].items()} == MLP.PER_MODULE_LOGICAL
    assert {k: v["unique_bytes"] for k, v in s["modules"].items()} == MLP.PER_MODULE_UNIQUE


def test_steps_split_at_backward(mlp):
    """Each backward ends a step; per-step figures equal one forward's bytes."""
    x = MLP.batch()
    with PackedBytesTracker() as t:
        for _ in range(3):
            mlp(x).sum().backward()
    steps = t.steps()
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert [s["logical_bytes"] for s in steps] == [MLP.LOGICAL] * 3
    assert [s["unique_bytes"] for s in steps] == [MLP.UNIQUE] * 3
    assert t.summary()["logical_bytes"] == 3 * MLP.LOGICAL
    assert t.summary()["steps"] == 3


def test_explicit_step_without_auto(mlp):
    """With auto_step=False only step() splits; two forwards before it land in one step."""
    x = MLP.batch()
    with PackedBytesTracker(auto_step=False) as t:
        mlp(x).sum().backward()
        mlp(x).sum().backward()
        first = t.step()
        mlp(x).sum().backward()
    assert first["logical_bytes"] == 2 * MLP.LOGICAL
    assert [s["logical_bytes"] for s in t.steps()] == [2 * MLP.LOGICAL, MLP.LOGICAL]


def test_reset_and_reentry(mlp):
    """reset() zeroes the counts; the same tracker can be entered again but not twice at once."""
    t = PackedBytesTracker()
    with t:
        mlp(MLP.batch()).sum().backward()
        with pytest.raises(ProfilingError, match="already active"):
            t.__enter__()
    t.reset()
    assert t.summary()["packed_bytes"] == 0
    with t:
        mlp(MLP.batch()).sum().backward()
    assert t.logical_bytes == MLP.LOGICAL


def test_inplace_change_after_save_raises():
    """The tracker's hooks keep autograd's in-place check (hooks bypass it otherwise)."""
    x = torch.randn(4, requires_grad=True)
    with PackedBytesTracker():
        h = x * 2
        z = h.sin()
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_chained_user_hooks_run(mlp):
    """User pack/unpack functions run behind the tracker's own counting."""
    calls = {"pack": 0, "unpack": 0}

    def pack(t):
        calls["pack"] += 1
        return t.clone()

    def unpack(t):
        calls["unpack"] += 1
        return t

    ref = MLP()
    ref.load_state_dict(mlp.state_dict())
    x = MLP.batch()
    ref(x).sum().backward()
    with PackedBytesTracker(pack_hook=pack, unpack_hook=unpack) as t:
        mlp(x).sum().backward()
    assert calls == {"pack": 4, "unpack": 4}
    assert t.logical_bytes == MLP.LOGICAL
    for a, b in zip(_grads(mlp), _grads(ref)):
        assert torch.equal(a, b)


def test_table_and_json(tmp_path, mlp):
    """The text table lists every module and the JSON round-trips the summary numbers."""
    import json

    with PackedBytesTracker() as t:
        mlp(MLP.batch()).sum().backward()
    table = t.table(unit="B")
    for name in MLP.PER_MODULE_LOGICAL:
        assert name in table
    assert "TOTAL" in table and "320 B" in table
    data = json.loads(t.to_json(tmp_path / "p.json").read_text())
    assert data["logical_bytes"] == MLP.LOGICAL
    assert data["per_step"][0]["modules"]["MLP.1"]["logical_bytes"] == 128


# ---------------------------------------------------------------- with the engine
@pytest.mark.parametrize("order", ["tracker_inside_engine", "engine_inside_tracker"])
def test_tracker_matches_engine_and_keeps_offloading(order, toy):
    """Either nesting: tracker packed == engine packed, engine still offloads, grads unchanged."""
    model, tokens, _ = toy
    ref_engine = OffloadActivations(device="cpu")
    with ref_engine:
        loss = model(tokens).float().pow(2).mean()
    loss.backward()
    ref_grads = _grads(model)
    model.zero_grad()

    engine = OffloadActivations(device="cpu")
    tracker = PackedBytesTracker()
    if order == "tracker_inside_engine":
        with engine:
            with tracker:
                assert not tracker.own_hooks_installed
                loss = model(tokens).float().pow(2).mean()
    else:
        with tracker:
            assert tracker.own_hooks_installed
            with engine:
                loss = model(tokens).float().pow(2).mean()
    loss.backward()

    led = engine.ledger.summary()
    s = tracker.summary()
    assert led["offloaded_bytes"] > 0
    assert led["offloaded_bytes"] == ref_engine.ledger.summary()["offloaded_bytes"]
    assert s["packed_bytes"] == led["packed_bytes"]
    assert s["packed_count"] == led["packed_count"]
    assert s["via_engine_bytes"] == led["packed_bytes"]
    assert s["static_bytes"] == led["kept_by_reason"].get("parameter", 0)
    assert tracker.engine is engine
    for a, b in zip(_grads(model), ref_grads):
        assert torch.equal(a, b)


def test_no_double_count_across_engine_boundary(mlp):
    """Tracker hooks outside, engine inside: packs inside come via the engine, outside via the hooks, once each."""
    x = MLP.batch()
    engine = OffloadActivations(device="cpu", min_offload_size=0)
    with PackedBytesTracker() as t:
        with engine:
            out = mlp(x)  # inside the engine: the tracker's hooks are shadowed
        loss = (out * out).sum()  # outside: saves `out` twice through the tracker's hooks
    loss.backward()
    led = engine.ledger.summary()
    s = t.summary()
    assert led["packed_bytes"] == MLP.LOGICAL + MLP.STATIC
    assert led["offloaded_bytes"] > 0
    assert s["via_engine_bytes"] == led["packed_bytes"]
    assert s["packed_bytes"] == led["packed_bytes"] + 2 * out.numel() * F32
    assert s["logical_bytes"] == MLP.LOGICAL + 2 * out.numel() * F32


def test_steps_follow_engine_backward(toy):
    """Inside an engine, the tracker's steps split where the engine closes its ledger steps."""
    model, tokens, _ = toy
    engine = OffloadActivations(device="cpu")
    with engine:
        with PackedBytesTracker() as t:
            for _ in range(2):
                model(tokens).float().mean().backward()
    steps = t.steps()
    assert len(steps) == 2 == len(engine.ledger.step_totals)
    assert [s["packed_bytes"] for s in steps] == [st.packed_bytes for st in engine.ledger.step_totals]


def test_unique_bytes_survive_address_reuse():
    """A storage the engine frees mid-forward and whose address is reused counts as a new storage."""
    x = torch.randn(256, 256, requires_grad=True)

    def fwd():
        y = x
        for _ in range(6):
            y = (y + 1).sin()  # sin saves its (fresh) input: 256 KiB each
        return y

    with PackedBytesTracker() as alone:
        fwd().sum().backward()
    with OffloadActivations(device="cpu", max_fwd_stash_size=1):
        with PackedBytesTracker() as observed:
            y = fwd()
    y.sum().backward()
    assert alone.unique_bytes == 6 * 256 * 256 * F32
    assert observed.unique_bytes == alone.unique_bytes


def test_nested_trackers_both_count(mlp):
    """A tracker entered inside another (no engine) shares its hooks: both count every pack once."""
    x = MLP.batch()
    with PackedBytesTracker() as outer:
        mlp(x).sum().backward()
        with PackedBytesTracker() as inner:
            assert not inner.own_hooks_installed
            mlp(x).sum().backward()
        mlp(x).sum().backward()
    assert outer.logical_bytes == 3 * MLP.LOGICAL and [s["logical_bytes"] for s in outer.steps()] == [MLP.LOGICAL] * 3
    assert inner.logical_bytes == MLP.LOGICAL and inner.summary()["steps"] == 1


def test_memprofiler_inside_a_user_tracker(tmp_path, mlp):
    """A MemProfiler window inside a user's tracker does not hide packs from the user's tracker."""
    from offload.profiling import MemProfiler, MemProfilerCfg

    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path), mlp)
    x = MLP.batch()
    with PackedBytesTracker() as user:
        for _ in range(3):
            with prof.profile("training_step"):
                mlp(x).sum().backward()
    assert user.logical_bytes == 3 * MLP.LOGICAL
    assert prof.memory_stats["0.training_step.2.end"]["npp_diff"] == MLP.LOGICAL


def test_user_hooks_inside_a_tracker_forward(mlp):
    """A tracker with user hooks inside another installs its own hooks and still feeds the outer one."""
    seen = []
    x = MLP.batch()
    with PackedBytesTracker() as outer:
        with PackedBytesTracker(pack_hook=lambda t: seen.append(1) or t, unpack_hook=lambda t: t) as inner:
            assert inner.own_hooks_installed
            mlp(x).sum().backward()
        mlp(x).sum().backward()
    assert len(seen) == 4 and inner.logical_bytes == MLP.LOGICAL
    assert outer.logical_bytes == 2 * MLP.LOGICAL


def test_reentered_per_step_counts_steps(mlp):
    """`for _ in range(3): with t: step()` gives 3 steps of one forward each (was 1 step of 3x)."""
    t = PackedBytesTracker()
    x = MLP.batch()
    for _ in range(3):
        with t:
            mlp(x).sum().backward()
    assert [s["logical_bytes"] for s in t.steps()] == [MLP.LOGICAL] * 3
    assert t.summary()["steps"] == 3


def test_unique_bytes_count_the_spanned_slice_not_the_storage():
    """A saved batch slice counts the bytes it spans; overlapping slices count their union."""
    data = torch.randn(1000, 640)  # 2.5 MB
    w = torch.randn(640, 2, requires_grad=True)
    with PackedBytesTracker() as t:
        a = data[:4] @ w  # saves data[:4]: 4 * 640 * 4 = 10240 B
        b = data[2:6] @ w  # overlaps rows 2..3: adds rows 4..5 only
    (a.sum() + b.sum()).backward()
    row = 640 * F32
    s = t.summary()
    assert s["unique_bytes"] == 6 * row  # w's grad needs only the slices (data needs no grad)
    assert s["logical_bytes"] == 8 * row


def test_per_module_offloaded_and_kept_by_reason(toy):
    """Under an engine every module's bytes split into offloaded + kept by the engine's reasons."""
    model, tokens, _ = toy
    engine = OffloadActivations(device="cpu")
    with PackedBytesTracker(model=model) as t, engine:
        loss = model(tokens).float().mean()
    loss.backward()
    s = t.summary()
    led = engine.ledger.summary()
    assert s["offloaded_bytes"] == led["offloaded_bytes"] > 0
    assert s["kept_by_reason"] == led["kept_by_reason"]
    for m in s["modules"].values():
        assert m["offloaded_bytes"] + sum(m["kept_by_reason"].values()) == m["packed_bytes"]
    by_mod: dict[str, int] = {}
    for r in engine.ledger.records:
        if r.decision == "offloaded":
            by_mod[r.module] = by_mod.get(r.module, 0) + r.nbytes
    assert {k: v["offloaded_bytes"] for k, v in s["modules"].items() if v["offloaded_bytes"]} == by_mod
