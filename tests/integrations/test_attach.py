"""ctx.attach(model): offloading with no change to the loop, exception-safe, nested- and compile-safe."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

from offload import OffloadActivations, active_engine
from offload._observers import _engines
from offload.modules import current_modules, register_model
from offload_testkit import (
    RECORD_FIELDS,
    TINY,
    ToyLlama,
    assert_really_offloaded,
    assert_same_grads,
    cpu_ctx,
    loss_of,
    make_batch,
    twin_of,
)


def _toy() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return ToyLlama(TINY), make_batch(TINY, 2, 16)


def test_attach_offloads_bitwise_and_backward_runs_outside():
    """An attached model offloads its forward with no `with` block; grads are bitwise the twin's."""
    model, inputs = _toy()
    twin = twin_of(model)
    ctx = cpu_ctx()
    handle = ctx.attach(model)
    loss = loss_of(model, inputs)
    assert active_engine() is None, "the engine must be left when forward returns"
    loss.backward()
    loss_of(twin, inputs).backward()
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
    assert handle.calls == 1 and len(ctx.ledger.step_totals) == 1


def test_several_calls_per_step_each_enter_once():
    """Two forwards before one backward (e.g. two micro-batches): each call enters and leaves once."""
    model, inputs = _toy()
    twin = twin_of(model)
    ctx = cpu_ctx()
    handle = ctx.attach(model)
    (loss_of(model, inputs) + loss_of(model, inputs)).backward()
    (loss_of(twin, inputs) + loss_of(twin, inputs)).backward()
    assert_same_grads(model, twin)
    assert handle.calls == 2
    assert ctx.ledger.summary()["offloaded_count"] > 0


class _Recursive(nn.Module):
    """Calls itself once from inside its forward (a nested call of the attached root)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.depths: list[int] = []

    def forward(self, x: torch.Tensor, again: bool = True) -> torch.Tensor:
        self.depths.append(sum(e is self.engine for e in _engines()))
        y = torch.tanh(self.lin(x))
        return self(y, again=False) if again else y


def test_nested_call_does_not_enter_twice():
    """A model called inside its own forward is entered once (the engine is on the stack once)."""
    torch.manual_seed(0)
    model = _Recursive()
    twin = twin_of(model)
    ctx = cpu_ctx()
    model.engine = twin.engine = ctx
    handle = ctx.attach(model)
    x = torch.randn(4, 16)
    model(x).sum().backward()
    assert model.depths == [1, 1], model.depths
    assert handle.calls == 1 and active_engine() is None
    twin(x).sum().backward()
    assert_same_grads(model, twin)


class _Fails(nn.Module):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.exc = exc
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x)) * 2
        if self.armed:
            raise self.exc
        return y


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()], ids=["Exception", "KeyboardInterrupt"])
def test_forward_raising_leaves_the_engine(exc):
    """A forward that raises (KeyboardInterrupt included) leaves no engine entered and no module stack,
    at the latest when the model is next called; later steps are bitwise."""
    torch.manual_seed(0)
    model = _Fails(exc)
    twin = twin_of(model)
    ctx = cpu_ctx()
    handle = ctx.attach(model)
    x = torch.randn(4, 16)
    with pytest.raises(type(exc)):
        model(x)
    if isinstance(exc, Exception):
        # always_call hook: left at once.
        assert active_engine() is None and current_modules() == []
    model.armed = twin.armed = False
    model(x).sum().backward()  # repairs a KeyboardInterrupt's leftover state first
    assert active_engine() is None and current_modules() == []
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    twin(x).sum().backward()
    assert_same_grads(model, twin)
    assert ctx.ledger.summary()["offloaded_count"] > 0
    assert handle.calls == 2


def test_remove_after_keyboard_interrupt_leaves_the_engine():
    """handle.remove() after an interrupted forward pops the engine's hooks and detaches."""
    torch.manual_seed(0)
    model = _Fails(KeyboardInterrupt())
    ctx = cpu_ctx()
    handle = ctx.attach(model)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(4, 16))
    assert active_engine() is ctx  # PyTorch skips always_call hooks for a BaseException
    handle.remove()
    assert active_engine() is None and current_modules() == []
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not handle.active and handle.engine is None


def test_interrupted_forward_then_other_hooks_still_leaves_the_engine():
    """A forward interrupted by KeyboardInterrupt, then the model called inside another saved-tensor hooks
    context: the engine leaves (warned) with that context's hooks kept innermost; once it exits nothing
    is left entered and later steps are bitwise."""
    torch.manual_seed(0)
    model = _Fails(KeyboardInterrupt())
    twin = twin_of(model)
    ctx = cpu_ctx()
    ctx.attach(model)
    x = torch.randn(4, 16)
    with pytest.raises(KeyboardInterrupt):
        model(x)
    model.armed = twin.armed = False
    packed = []
    inner = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t)
    with inner:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            model(x).sum().backward()  # the leftover engine leaves; this call enters it inside `inner`
        assert any("left the engine entered; leaving it now" in str(m.message) for m in w), [str(m.message) for m in w]
        assert active_engine() is None
        n = len(packed)
        torch.randn(4, 4, requires_grad=True).sin()
        assert len(packed) == n + 1, "the inner context's hooks stay innermost"
    assert active_engine() is None and current_modules() == []
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    twin(x).sum().backward()
    model(x).sum().backward()
    twin(x).sum().backward()
    assert_same_grads(model, twin)
    assert ctx.ledger.summary()["offloaded_count"] > 0


def test_remove_detaches():
    """After handle.remove() the model's forward is no longer offloaded."""
    model, inputs = _toy()
    ctx = cpu_ctx()
    handle = ctx.attach(model)
    loss_of(model, inputs).backward()
    packed = ctx.ledger.summary()["packed_count"]
    assert packed > 0
    handle.remove()
    handle.remove()  # idempotent
    loss_of(model, inputs).backward()
    assert ctx.ledger.summary()["packed_count"] == packed


def test_attach_inside_explicit_context_records_once():
    """Calling an attached model inside `with ctx:` does not enter the engine a second time."""
    model, (x, _) = _toy()
    model_b = twin_of(model)
    ctx_a, ctx_b = cpu_ctx(), cpu_ctx()
    ctx_a.attach(model)
    seen: list[int] = []
    model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(sum(e is ctx_a for e in _engines())))
    with ctx_a:
        out_a = model(x)
    assert seen == [1], seen
    ctx_b.attach(model_b)
    out_b = model_b(x)
    assert ctx_a.ledger.summary()["packed_count"] == ctx_b.ledger.summary()["packed_count"] > 0
    out_a.sum().backward()
    out_b.sum().backward()
    assert_same_grads(model, model_b)


def test_attached_engine_lives_with_the_model():
    """`OffloadActivations(...).attach(model)` needs no variable: the model's hooks keep the engine."""
    import gc

    model, inputs = _toy()
    handle = cpu_ctx().attach(model)
    gc.collect()
    loss_of(model, inputs).backward()
    assert handle.engine is not None
    assert_really_offloaded(handle.engine)


def test_compiled_blocks_under_attach_bitwise():
    """Blocks compiled with torch.compile run under an attached root with bitwise grads."""
    model, inputs = _toy()
    for block in model.layers:
        block.compile(backend="aot_eager")  # in place: no OptimizedModule wrapper
    twin = twin_of(model)
    ctx = cpu_ctx()
    ctx.attach(model)
    loss_of(model, inputs).backward()
    loss_of(twin, inputs).backward()
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)


def test_attach_rejects_a_non_module():
    """attach() names what it needs when given something else."""
    with pytest.raises(TypeError, match="nn.Module"):
        cpu_ctx().attach("model")


class _RootBuffer(nn.Module):
    """A root that uses its own buffer in its own forward, above nested Sequentials (named alike twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(32, 32)
        self.register_buffer("scale", torch.rand(32) + 0.5)
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(2)))
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.emb(x) * self.scale))


def _model_and_inputs(kind: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    if kind == "root_buffer":
        return _RootBuffer(), (torch.randn(16, 32), torch.randint(0, 8, (16,)))
    return _toy()


_FIELDS = tuple(f for f in RECORD_FIELDS if f != "storage_key")  # an address: the allocator's choice


def _decisions(ctx: OffloadActivations) -> list[tuple]:
    return [tuple(getattr(r, f) for f in _FIELDS) for r in ctx.ledger.records]


def _step(kind: str, how: str) -> tuple[list[tuple], nn.Module, nn.Module]:
    """One step of a fresh ``kind`` model entered ``how``; its records, the model and its untouched twin."""
    model, inputs = _model_and_inputs(kind)
    twin = twin_of(model)
    ctx = cpu_ctx(model=model if how.endswith("model=") else None)
    if how.endswith("register_model"):
        register_model(model)
    if how.startswith("with"):
        with ctx:
            out = model(inputs[0])
    else:
        ctx.attach(model)
        out = model(inputs[0])
    out.float().square().mean().backward()  # outside the engine, as attach leaves it
    twin(inputs[0]).float().square().mean().backward()
    assert_really_offloaded(ctx)
    return _decisions(ctx), model, twin


@pytest.mark.parametrize("kind", ["root_buffer", "toy"])
@pytest.mark.parametrize("how", ["attach", "attach, model=", "attach, register_model", "with, model="])
def test_attach_decides_and_names_as_with(kind, how):
    """attach (with or without model= / register_model) records what `with ctx:` records, record for record."""
    want, _, _ = _step(kind, "with")
    assert any(r[_FIELDS.index("reason")] == "buffer" for r in want), "the model saves no buffer"
    got, model, twin = _step(kind, how)
    assert got == want
    assert_same_grads(model, twin)


class _Wrapper(nn.Module):
    """Scales what it wraps by its own buffer; with ``ctx``, enters the engine inside its own forward."""

    def __init__(self, inner: nn.Module, ctx: OffloadActivations | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.ctx = ctx
        self.register_buffer("gain", torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx if self.ctx is not None else contextlib.nullcontext():
            return self.inner(x) * self.gain


def test_with_inside_a_forward_decides_and_names_as_around_the_call():
    """`with ctx:` opened inside a model's forward keeps that model's buffers and names as around the call."""
    runs = []
    for inside in (False, True):
        model, (x, _) = _model_and_inputs("root_buffer")
        twin = twin_of(model)
        ctx = cpu_ctx()
        torch.manual_seed(1)
        wrapper = _Wrapper(model, ctx if inside else None)
        if inside:
            out = wrapper(x)
        else:
            with ctx:
                out = wrapper(x)
        out.square().mean().backward()
        twin(x).mul(wrapper.gain).square().mean().backward()
        assert_same_grads(model, twin)
        runs.append(_decisions(ctx))
    around, inside = runs
    assert ("_Wrapper", "buffer") in {(r[_FIELDS.index("module")], r[_FIELDS.index("reason")]) for r in around}
    assert inside == around
