"""An offloaded tensor whose original something else keeps alive is not reloaded (NOTE [ Copy schedule ]
item 6): backward unpacks a view of the original (ledger note ``reused_original``, no host-to-device
bytes), bitwise as without the engine; dropped or modified originals take the usual paths."""

from __future__ import annotations

import pytest
import torch

import offload


def _step(x: torch.Tensor, table: torch.Tensor, w: torch.Tensor, engine=None) -> torch.Tensor:
    ctx = engine if engine is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with ctx:
        return ((x @ w) * table).square().sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(40, 8, generator=g)
    return torch.randn(16, 8, generator=g), big, torch.randn(8, 8, generator=g)


@pytest.mark.parametrize("held", [True, False])
def test_an_original_held_elsewhere_is_reused_and_one_dropped_is_reloaded(held):
    """The caller holds ``x`` and the table (a view at an offset of a bigger tensor, as a model's rotary
    table slice is): their unpacks are views of them, with no reload; dropped before backward, they are
    reloaded. The gradient is bitwise the one without the engine either way."""
    x, big, w0 = _inputs()
    w, w2 = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    _step(x, big[4:20], w2).backward()
    engine = offload.OffloadActivations(device="cpu", min_offload_size=0)
    loss = _step(x, big[4:20], w, engine)
    ptrs = {t.untyped_storage().data_ptr() for t in (x, big)}
    if not held:
        del x, big
    loss.backward()
    assert torch.equal(w.grad, w2.grad)
    recs = [r for r in engine.ledger.records if r.decision == "offloaded"]
    theirs = [r for r in recs if r.storage_key in ptrs]
    assert len(theirs) == 2 and len(recs) == 3  # (and the product the square saved: nobody holds it)
    reloaded = sum(r.nbytes for r in recs if r.note != "reused_original")
    if held:
        assert {r.note for r in theirs} == {"reused_original"}
        assert engine.ledger.summary()["h2d_bytes"] == reloaded == recs[-1].nbytes
    else:
        assert not {r.note for r in recs} & {"reused_original"}
        assert engine.ledger.summary()["h2d_bytes"] == reloaded


def test_an_original_modified_in_place_after_forward_is_refused_not_reused():
    """A held original written in place after its save: backward raises the in-place error, as without the
    engine (its bytes are not the saved ones any more)."""
    x, big, w0 = _inputs()
    table = big[4:20]
    engine = offload.OffloadActivations(device="cpu", min_offload_size=0)
    loss = _step(x, table, w0.clone().requires_grad_(), engine)
    table.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_an_in_place_write_through_one_reused_view_is_seen_by_its_sibling():
    """Two saved views of one live original (q and k of one projection): backward writes through k's
    unpacked tensor in place; q's unpack must raise, as autograd does without the engine (the views share
    the original's version counter: Rule 6). Found by the device-thread suite when the reused view was a
    tensor of its own."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_hardening import _ZeroInBackward

    a = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(128, requires_grad=True)
    with offload.OffloadActivations(device="cpu", min_offload_size=0) as engine:
        base = a * 1.5  # (held by this frame through backward)
        q, k = base[:, :128], base[:, 128:]
        loss = (q * w).sum() + _ZeroInBackward.apply(k).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert any(r.note == "reused_original" for r in engine.ledger.records)
