"""Rule 5's link exception: a view spread over more than twice its bytes (v of a fused qkv projection, a
strided slice) moves only its elements (gathered densely before the copy, scattered back after the reload)
and still comes back with its exact size and stride (what torch.compile's backward asserts), its values,
and gradients bitwise equal to a twin's; a view that covers most of its span still copies the span, shared
by its siblings (Rule 7)."""

from __future__ import annotations

import pytest
import torch

from offload._spans import byte_span
from offload.testing import EmulatedAccelerator
from offload_testkit import Recorder, SaveView, assert_same_grads, cpu_ctx, twin_of


def _fused_v(x: torch.Tensor) -> torch.Tensor:
    """v of a fused (B, T, 3 * H * D) projection, as attention saves it: (B, H, T, D), spread over 3x."""
    b, t, c = x.shape
    return x.view(b, t, 3, 4, c // 12)[:, :, 2].transpose(1, 2)


VIEWS = {
    "fused_qkv_v": _fused_v,  # spread 3x: gathered
    "every_third": lambda x: x[..., ::3],  # spread ~3x: gathered
    "left_half": lambda x: x[..., : x.shape[-1] // 2],  # spread ~2x, at the threshold: the span
    "transpose": lambda x: x.transpose(0, 1),  # dense: the span (its own bytes)
    "row_slice": lambda x: x[1:],  # contiguous: its span
}


def _layout_of(make_view, x):
    v = make_view(x.detach())
    return v.size(), v.stride(), v.clone(), byte_span(v), v.numel() * v.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(VIEWS))
def test_spread_view_moves_its_bytes_and_keeps_its_layout(name, dtype):
    make_view = VIEWS[name]
    base = torch.randn(2, 6, 48).to(dtype)
    x = base.clone().requires_grad_()
    size, stride, value, (lo, hi), nbytes = _layout_of(make_view, x)
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    seen: list = []
    with ctx:
        y = SaveView.apply(x, make_view, seen)
    y.sum().backward()
    (got,) = seen
    assert (got["size"], got["stride"]) == (size, stride), f"{name}: came back as {got['size']}/{got['stride']}"
    assert torch.equal(got["value"], value), f"{name}: values changed on the round trip"
    (r,) = [r for r in rec.records if r.decision == "offloaded"]
    if 2 * nbytes < hi - lo:
        assert r.copy_bytes == nbytes, f"{name}: {r.copy_bytes} bytes copied for a {nbytes}-byte view"
    else:
        assert r.copy_bytes >= hi - lo, f"{name}: {r.copy_bytes} bytes copied, span {hi - lo}"
    x2 = base.clone().requires_grad_()
    SaveView.apply(x2, make_view, []).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_gathered_copies_are_not_shared_with_other_views():
    """Two different spread views of one storage each get their own gathered copy and their own values."""
    x = torch.randn(2, 6, 48, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ctx = cpu_ctx()
    with ctx:
        a = x * 2
        loss = (a[..., ::3].sin().sum() + a[..., 1::3].cos().sum() + _fused_v(a).exp().sum())
    loss.backward()
    a2 = x2 * 2
    (a2[..., ::3].sin().sum() + a2[..., 1::3].cos().sum() + _fused_v(a2).exp().sum()).backward()
    assert torch.equal(x.grad, x2.grad)
    off = [r for r in ctx.ledger.records if r.decision == "offloaded"]
    assert sum(r.copy_bytes for r in off) <= 3 * a.numel() * a.element_size(), [(r.shape, r.copy_bytes) for r in off]


class _Attention(torch.nn.Module):
    """A fused-qkv attention whose last save is v, a view spread over 3x its bytes (SDPA saves it)."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = torch.nn.Linear(48, 144, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, 4, 12).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q * 0.5, k * 0.25, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


@pytest.mark.emulated
@pytest.mark.parametrize("late", [False, True], ids=["check", "late"])
@pytest.mark.parametrize("reuse", [False, True], ids=["reloaded", "reused_source"])
def test_gathered_copy_on_the_stream_path(late, reuse):
    """Under the emulator (every op checked for a happens-before order; late: side-stream work really late):
    the gathered v of a fused-qkv attention, reloaded (stash bounded to one copy) or used as its live dense
    source (stash unbounded, backward on another stream), is bitwise the twin's with zero hazards."""
    torch.manual_seed(0)
    model = _Attention()
    twin = twin_of(model)
    x = torch.randn(2, 16, 48)
    with EmulatedAccelerator(late=late) as acc:
        ctx = cpu_ctx(timing=False, **({"device_budget_bytes": 1 << 50} if reuse else {"max_fwd_stash_size": 1}))
        default = acc.default_stream()
        bwd = acc.Stream(late=False, name="backward")
        with ctx:
            loss = model(x)
        bwd.wait_stream(default)
        with acc.stream(bwd):
            loss.backward()
        default.wait_stream(bwd)
        twin(x).backward()
        acc.synchronize()
    acc.assert_no_hazards()
    assert_same_grads(model, twin)
    gathered = [r for r in ctx.ledger.records
                if r.decision == "offloaded" and r.shape == (2, 4, 16, 12) and r.copy_bytes == r.nbytes
                and r.storage_nbytes == 3 * r.nbytes]
    assert gathered, [(r.shape, r.copy_bytes, r.storage_nbytes) for r in ctx.ledger.records]
    assert any(r.note == "reused_source" for r in gathered) == reuse, [r.note for r in gathered]
