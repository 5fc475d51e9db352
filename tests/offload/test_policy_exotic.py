"""Saved tensors that their bytes alone cannot rebuild stay where they are, with a recorded reason.

Efficient zero tensors (what forward-mode AD and ``torch.func.jvp`` save), strided
nested tensors, quantized tensors, sparse / mkldnn / jagged layouts, meta and
fake tensors and storage-less wrappers must never crash the pack hook and must
come back exactly as saved; ordinary-but-unusual dense tensors (float8, bool,
complex32, odd storage sizes, zero elements, expanded, conjugated) must still
round-trip bitwise through the host pool. Every test compares with the same
computation run without the engine, bitwise.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from offload import OffloadActivations
from offload.policy import UNSUPPORTED_TYPE, classify, is_unsupported

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _ctx() -> OffloadActivations:
    return OffloadActivations(device="cpu", min_offload_size=0)


def _reasons(ctx: OffloadActivations) -> dict[str, int]:
    return ctx.ledger.summary()["kept_count_by_reason"]


def _assert_reconciles(ctx: OffloadActivations) -> None:
    s = ctx.ledger.summary()
    assert s["packed_count"] == s["offloaded_count"] + s["kept_count"], s
    assert s["packed_bytes"] == s["offloaded_bytes"] + s["kept_bytes"], s
    assert s["kept_bytes"] == sum(s["kept_by_reason"].values()), s


def test_efficient_zero_tensor_saved_by_mul():
    """x * efficient-zero: the saved zero tensor is kept (unsupported_type), the gradient is bitwise equal."""
    grads = []
    for use in (False, True):
        ctx = _ctx()
        x = torch.randn(64, requires_grad=True)
        with ctx if use else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = x * torch._efficientzerotensor(64)
        (y.sin() + x).sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    assert _reasons(ctx).get(UNSUPPORTED_TYPE, 0) >= 1, _reasons(ctx)
    _assert_reconciles(ctx)


def _hvp_forward_over_reverse(x: torch.Tensor, v: torch.Tensor, ctx) -> tuple[torch.Tensor, ...]:
    """Hessian-vector product of f(x) = sum(sin(x) * x**3) by forward-mode AD over reverse mode,
    all inside ``ctx`` (as in a loss with a gradient penalty); then a backward through the gradient."""
    with fwAD.dual_level():
        d = fwAD.make_dual(x, v)
        with ctx:
            y = (d.sin() * d * d * d).sum()
            (g,) = torch.autograd.grad(y, d, create_graph=True)  # saves efficient zero tangents
        gp, tangent = fwAD.unpack_dual(g)
        gp.pow(2).sum().backward()
        return gp.detach(), tangent.detach(), x.grad


def test_forward_over_reverse_hvp_with_zero_tangents():
    """Forward-over-reverse HVP through the context (zero tensors saved): same product and grads bitwise."""
    torch.manual_seed(0)
    x = torch.randn(256, requires_grad=True)
    v = torch.randn(256)
    ref = _hvp_forward_over_reverse(x, v, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    x.grad = None
    ctx = _ctx()
    got = _hvp_forward_over_reverse(x, v, ctx)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    zero = [r for r in ctx.ledger.records if r.reason == UNSUPPORTED_TYPE]
    assert zero, _reasons(ctx)
    _assert_reconciles(ctx)


def test_jvp_through_the_context():
    """torch.func.jvp of a function run inside the context: same primal and tangent bitwise."""
    torch.manual_seed(0)
    x, v = torch.randn(128), torch.randn(128)

    def f(a: torch.Tensor) -> torch.Tensor:
        return (a.sin() * a).tanh()

    ref = torch.func.jvp(f, (x,), (v,))
    ctx = _ctx()
    with ctx:
        got = torch.func.jvp(f, (x,), (v,))
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    _assert_reconciles(ctx)


def test_strided_nested_tensor():
    """Ops on a strided nested tensor save nested tensors: kept (no single shape), grads bitwise equal."""
    torch.manual_seed(0)
    parts = [torch.randn(2, 8), torch.randn(3, 8)]
    grads = []
    for use in (False, True):
        ctx = _ctx()
        nt = torch.nested.nested_tensor([p.clone() for p in parts], requires_grad=True)
        with ctx if use else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = (nt.sin() * nt).cos()
        torch.nested.to_padded_tensor(y, 0.0).sum().backward()
        grads.append(torch.nested.to_padded_tensor(nt.grad, 0.0))
    assert torch.equal(grads[0], grads[1])
    recs = [r for r in ctx.ledger.records if r.reason == UNSUPPORTED_TYPE]
    assert recs and all(r.shape == () for r in recs), [(r.reason, r.shape) for r in ctx.ledger.records]
    _assert_reconciles(ctx)


class _SaveOther(torch.autograd.Function):
    """y = 2 x; backward adds a checksum of the saved tensor, so a wrong reload changes the gradient."""

    @staticmethod
    def forward(ctx, x, other, checksum):
        ctx.save_for_backward(other)
        ctx.checksum = checksum
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (o,) = ctx.saved_tensors
        _SaveOther.seen.append(o)
        return g * 2 + ctx.checksum(o), None, None

    seen: list = []


def _dense_sum(o: torch.Tensor) -> torch.Tensor:
    if o.dtype == torch.bool:
        return o.sum().to(torch.float32)
    if o.is_complex():
        o = torch.view_as_real(o.resolve_conj().to(torch.complex64))
    return o.to(torch.float64).sum().to(torch.float32)


def _odd_storage() -> torch.Tensor:
    st = torch.arange(7, dtype=torch.uint8).untyped_storage()  # 7 bytes: not a multiple of 2
    return torch.empty(0, dtype=torch.float16).set_(st, 0, (3,), (1,))


def _quantized_per_channel() -> torch.Tensor:
    return torch.quantize_per_channel(torch.randn(4, 8), torch.rand(4) + 0.1, torch.zeros(4, dtype=torch.long),
                                      0, torch.quint8)


class _Wrapper(torch.Tensor):
    pass


# name -> (make the saved tensor, checksum for backward, expected reason or "" for offloaded)
CASES = {
    "zero_tensor": (lambda: torch._efficientzerotensor(16), lambda o: o.sum(), UNSUPPORTED_TYPE),
    "quantized_per_tensor": (lambda: torch.quantize_per_tensor(torch.randn(16), 0.05, 3, torch.qint8),
                             lambda o: o.dequantize().sum() + o.q_scale() + o.q_zero_point(), UNSUPPORTED_TYPE),
    "quantized_per_channel": (_quantized_per_channel,
                              lambda o: o.dequantize().sum() + o.q_per_channel_scales().sum(), UNSUPPORTED_TYPE),
    "sparse_coo": (lambda: torch.randn(4, 4).relu().to_sparse(), lambda o: o.to_dense().sum(), UNSUPPORTED_TYPE),
    "sparse_csr": (lambda: torch.randn(4, 4).relu().to_sparse_csr(), lambda o: o.to_dense().sum(), UNSUPPORTED_TYPE),
    "mkldnn": (lambda: torch.randn(4, 4).to_mkldnn(), lambda o: o.to_dense().sum(), UNSUPPORTED_TYPE),
    "jagged_nested": (lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(5, 3)], layout=torch.jagged),
                      lambda o: sum(p.sum() for p in o.unbind()), UNSUPPORTED_TYPE),
    "functional_wrapper": (lambda: torch._to_functional_tensor(torch.randn(16)),
                           lambda o: torch._from_functional_tensor(o).sum(), UNSUPPORTED_TYPE),
    "subclass": (lambda: torch.randn(16).as_subclass(_Wrapper), lambda o: o.as_subclass(torch.Tensor).sum(),
                 UNSUPPORTED_TYPE),
    "meta": (lambda: torch.empty(16, device="meta"), lambda o: torch.tensor(float(o.numel())), "other_device"),
    "float8": (lambda: torch.randn(16).to(torch.float8_e4m3fn), _dense_sum, ""),
    "bool": (lambda: torch.randn(16) > 0, _dense_sum, ""),
    "complex32": (lambda: torch.randn(16, dtype=torch.complex64).to(torch.complex32), _dense_sum, ""),
    "conj": (lambda: torch.randn(16, dtype=torch.complex64).conj(), _dense_sum, ""),
    "expanded": (lambda: torch.randn(1, 8).expand(4, 8), _dense_sum, ""),
    "neg_view": (lambda: torch.randn(16, dtype=torch.complex64).conj().imag, _dense_sum, ""),
    "scalar_0d": (lambda: torch.tensor(3.25), _dense_sum, ""),
    "uint64": (lambda: torch.arange(16).mul(3).to(torch.uint64), lambda o: o.to(torch.float64).sum().float(), ""),
    "odd_storage_bytes": (_odd_storage, _dense_sum, ""),
    "zero_elements": (lambda: torch.empty(0, 3), _dense_sum, "too_small"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_exotic_saved_tensor_round_trips_or_is_kept(name):
    """Each kind of saved tensor: same gradient bitwise as without the engine, and the decision recorded."""
    make, checksum, reason = CASES[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = make()
    grads, seen = [], []
    for use in (False, True):
        ctx = _ctx()
        x = torch.randn(16, requires_grad=True, generator=torch.Generator().manual_seed(1))
        _SaveOther.seen = []
        with ctx if use else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = _SaveOther.apply(x, other, checksum)
        y.sum().backward()
        grads.append(x.grad)
        seen.append(_SaveOther.seen[0])
    assert torch.equal(grads[0], grads[1]), name
    plain, got = seen
    assert type(got) is type(plain) and got.dtype == plain.dtype and got.layout == plain.layout
    if plain.is_quantized:
        assert got.qscheme() == plain.qscheme()
        assert torch.equal(got.int_repr(), plain.int_repr())
    recs = list(ctx.ledger.records)
    assert len(recs) == 1, [(r.reason, r.decision) for r in recs]
    assert recs[0].reason == reason, (name, recs[0].reason)
    assert recs[0].decision == ("offloaded" if reason == "" else "kept")
    _assert_reconciles(ctx)


def test_order_a_small_parameter_is_parameter_and_tiny_exotics_are_unsupported():
    """Classification order: parameter > unsupported type > device > excluded > too_small, for tiny tensors too."""
    dev = torch.device("cpu")
    kw = dict(device=dev, min_offload_size=1 << 30, excluded=True, static_ptrs=set(), stack_modules=[])
    p = nn.Parameter(torch.randn(2))
    assert classify(p, **kw) == "parameter"
    assert classify(p.t(), **kw) == "parameter"
    assert classify(torch._efficientzerotensor(2), **kw) == UNSUPPORTED_TYPE
    assert classify(torch.quantize_per_tensor(torch.randn(2), 0.1, 0, torch.qint8), **kw) == UNSUPPORTED_TYPE
    assert classify(torch.empty(2, device="meta"), **kw) == "other_device"
    assert classify(torch.randn(2), **kw) == "excluded_region"
    assert classify(torch.randn(2), **{**kw, "excluded": False}) == "too_small"
    assert not is_unsupported(torch.randn(2)) and is_unsupported(torch.randn(2).to_sparse())


def test_buffer_found_through_the_running_module_stack():
    """A large registered buffer saved inside its module's forward is kept as "buffer", found lazily."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.randn(64))

        def forward(self, x):
            return x * self.table

    m = M()
    x = torch.randn(64, requires_grad=True)
    ctx = _ctx()
    with ctx:
        y = m(x)
    y.sum().backward()
    assert torch.equal(x.grad, m.table)
    assert _reasons(ctx).get("buffer") == 1, _reasons(ctx)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pass-through needs a machine without an accelerator")
@pytest.mark.parametrize("name", ["zero_tensor", "quantized_per_tensor", "functional_wrapper", "subclass"])
def test_pass_through_engine_records_exotics(name):
    """A pass-through engine (no accelerator, device=None) records exotic saves as "disabled", never crashes."""
    make, checksum, _ = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = OffloadActivations(min_offload_size=0)
        other = make()
    x = torch.randn(16, requires_grad=True)
    with ctx:
        y = _SaveOther.apply(x, other, checksum)
    y.sum().backward()
    assert [r.reason for r in ctx.ledger.records] == ["disabled"]


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pass-through needs a machine without an accelerator")
def test_pass_through_engine_nested():
    """A pass-through engine records strided nested saves without reading their (missing) shape."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = OffloadActivations(min_offload_size=0)
        nt = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], requires_grad=True)
    with ctx:
        y = nt.sin()
    torch.nested.to_padded_tensor(y, 0.0).sum().backward()
    assert [r.reason for r in ctx.ledger.records] == ["disabled"] and ctx.ledger.records[0].shape == ()
