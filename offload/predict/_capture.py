"""Capture: a training step of the user's model through the real engine, on fake tensors, as a ``Trace``.

NOTE [ Capture ]
1. What runs. ``model_fn()`` builds the model under ``FakeTensorMode`` (weights never materialised);
   the strategy is installed (``_strategies``); two steps run (forward in ``step_fn``, backward, the
   optimizer's step, gradients set to None), the first so that optimizer state and the engine's host
   pool exist, the second measured. Everything runs on fake *CPU* tensors: fake CUDA tensors abort
   this CPU-only build in scaled_dot_product_attention, and CPU SDPA takes a flash path (no S x S
   matrix), as flash attention does on a GPU; the prediction's assumptions say so.
2. The engine is the real one (``device="cpu"``) on the emulated accelerator's streams
   (``offload.testing.EmulatedAccelerator``): the same policy, dedupe, parameter detection, regions,
   pool, tiers and ledger as a real run, record for record (a fake tensor's storage has a unique id
   for a data pointer: ``offload._fake``).
3. What is recorded, in program order: every storage a dispatched op creates (``Alloc``, with the
   stream it was made on, its category and the module running) and its death (``Free``, from a weak
   reference to the storage); every op that is not a view or metadata-only (``Kernel``: FLOPs from
   ``torch.utils.flop_counter``, bytes read and written); copies between device and host memory
   (``Copy``); event records, waits and host synchronizations of the emulated streams; and
   ``record_stream``. Host memory (the engine's pool chunks and pageable buffers, announced by
   ``offload._pinned.HOST_ALLOC_OBSERVERS``) is left out of the device trace and counted per tier.
4. The measured step's trace opens with an ``Alloc`` for every device block alive when it starts
   (parameters, optimizer state, buffers), so a replay starts from the right state.
5. Categories are settled when the step ends: the storages of ``p.grad`` after backward are
   ``gradient``, the optimizer's state ``optimizer``, the model's parameters and buffers
   ``parameter``; a reload destination is ``copy``; what the forward (or a recompute) allocates is
   ``activation``, by module; ``kv_cache`` and ``logits`` (item 8); everything else ``other`` (inputs,
   gradients between modules in backward, the optimizer's temporaries).
6. In-flight copies. In the measured step, an event the engine polls (``Event.query``) is done when
   the modelled device has run it by the host's current time (``clock``: the timeline of the GPU
   predicted, run as the items are recorded: NOTE [ Simulated timeline ] rule 7), so the engine frees
   a copy's source when the copy would be done on that GPU, and sizes its reloads by the device memory
   the step holds (``memory_allocated``: the live device blocks, in program order, as the caching
   allocator counts them). Without a clock (and in the first step), a poll reports "not done" ``lag``
   times before "done" (default: never, until something waits for it).
7. A real model (``offload.plan(..., target=)``): its parameters and buffers are swapped for fake ones
   while the capture runs (``fake_parameters``), and the real tensors the step closes over (token ids)
   become fake when an op first reads them (``real_inputs``), each a device block from then on; so does a
   model built before the call (``lambda: model``) or on the meta device.
8. What the model says beyond its ops (its output head and vocabulary, its state's dtype, a KV cache it
   returns: the ``kv_cache`` and ``logits`` categories) is NOTE [ Model facts ] in ``_facts.py``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensor, FakeTensorMode, UnsupportedOperatorException,
                                           disable_fake_tensor_cache)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.weak import WeakIdKeyDictionary

from .. import _pinned
from .._torch_private import graph_task_id_c as _graph_task_id
from ..modules import current_module_name, track_modules
from ..testing import EmulatedAccelerator
from ..testing._aten_ops import _EMPTY_OPS, _METADATA_OPS
from ._errors import PredictError
from ._facts import ModelFacts, watching_outputs
from ._fsdp import fake_process_group, fsdp_categories, local, shard
from ._mixed import cuda_autocast, forward_autocast
from ._model import (_CudaOnStandIn, _block_names, _build, _hf_masks_as_real, _leaves, _local_bytes, _tensors,
                     fake_parameters)
from ._strategies import apply_strategy
from ._timeline import Clock
from ._trace import (COMPUTE_STREAM, Alloc, Copy, Free, HostSync, Kernel, RecordEvent, RecordStream, Trace,
                     WaitEvent)

__all__ = ["PredictError", "Captured", "capture", "settled", "fake_parameters"]

aten = torch.ops.aten
NEVER = 1 << 30
"""``lag`` for events that never report done by polling (NOTE [ Capture ] item 6)."""
_FAKE_ERRORS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
_STORAGE_ARG_OPS = {aten.set_.source_Storage, aten.set_.source_Storage_storage_offset}
"""Ops that take a storage: FakeTensorMode's dispatch cache would keep it alive in its key (so the storage
would never be freed), so they run with the cache off."""
_LIFT_OPS = {aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.lift.default}  # torch.tensor(): a
# fake constant (AdamW's step .item()) only if fake mode gets the real tensor, so as_fake leaves it alone
_CPU_SDPA = {getattr(aten, n).default for n in ("_scaled_dot_product_flash_attention_for_cpu",)
             if hasattr(aten, n)}
_CPU_SDPA_BWD = {getattr(aten, n).default for n in ("_scaled_dot_product_flash_attention_for_cpu_backward",)
                 if hasattr(aten, n)}


@dataclass(eq=False, slots=True)
class _Block:
    """One storage seen during the capture (device or host)."""

    id: int
    nbytes: int
    stream: int
    module: str
    category: str
    host: bool = False
    alive: bool = True


@dataclass
class Captured:
    """What a capture produced: the measured step's trace and what the engine recorded."""

    trace: Trace
    ledger_summary: dict[str, Any] | None
    """The engine's ``ledger.summary()`` over the measured step (None without an engine)."""
    host_bytes: dict[str, int]
    """Peak host bytes per tier in the measured step (pool: reserved; pageable: in use)."""
    param_bytes: int
    """Bytes of the model's parameters and buffers as built (after ``dtype``)."""
    block_names: list[str] = field(default_factory=list)
    """The model's candidate blocks (``offload.planner.find_blocks``), for grouping activations."""
    records: list[tuple] = field(default_factory=list)
    """The engine's decisions in the measured step, one per save: (nbytes, shape, dtype, module,
    decision, reason, tier, copy_bytes)."""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of model state one rank holds in the measured step: ``parameter``, ``buffer`` (not sharded),
    ``gradient`` (after backward), ``optimizer`` (after its step); sharded state by its local shard."""
    facts: ModelFacts = field(default_factory=ModelFacts)
    """The model's head, state dtype, KV cache, the step's autocast (NOTE [ Model facts ] in ``_facts.py``)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one op (torch.utils.flop_counter's formulas; CPU flash attention as the GPU one)."""
    if func in _CPU_SDPA:
        q, k, v = args[:3]
        return int(sdpa_flop_count(q.shape, k.shape, v.shape))
    if func in _CPU_SDPA_BWD:
        g, q, k, v = args[:4]
        return int(sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape))
    fn = flop_registry.get(func._overloadpacket)
    if fn is None:
        return 0
    try:
        return int(fn(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not take this overload's arguments
        return 0


class _Recorder(TorchDispatchMode):
    """Sees every aten op of the step (above FakeTensorMode) and hands it to the capture."""

    def __init__(self, cap: "_Capture") -> None:
        super().__init__()
        self.cap = cap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cap = self.cap
        if func is aten.record_stream.default:
            cap.record_stream(args[0], args[1])
            return None
        if cap.real_inputs and func not in _LIFT_OPS:
            args, kwargs = cap.as_fake((args, kwargs))
        try:
            if func in _STORAGE_ARG_OPS and cap.fake_mode is not None:
                with disable_fake_tensor_cache(cap.fake_mode):
                    out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
        except _FAKE_ERRORS as e:
            raise PredictError(
                f"offload.predict: the fake run cannot run {func} in module {current_module_name() or '<none>'!r}: "
                f"{type(e).__name__}: {e}. A prediction runs the step on fake tensors (shapes only), so an op "
                "whose output shape depends on tensor values (nonzero, masked_select, .item(), .tolist()) or an "
                "op without a fake/meta kernel cannot run; move it out of the step, or give it a meta kernel "
                "(torch.library.register_fake)."
            ) from e
        cap.on_op(func, args, kwargs, out)
        return out


class _Accelerator(EmulatedAccelerator):
    """The emulated accelerator, telling the capture about event records, waits and synchronizations; its
    polls answered by the capture's clock, its allocator statistics the capture's (NOTE [ Capture ] item 6)."""

    def __init__(self, cap: "_Capture", lag: int) -> None:
        super().__init__(late=False, check=False, dispatch=False, lag=lag)
        self.cap = cap

    def _ready(self, ev: Any) -> bool:
        clock = self.cap.clock
        if clock is not None and self.cap.recording:
            return clock.done(ev.id)
        return super()._ready(ev)

    def memory_allocated(self, device: Any = None) -> int:
        return self.cap.device_bytes

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.cap.device_peak

    def _record(self, ev: Any, s: Any) -> None:
        super()._record(ev, s)
        self.cap.emit(RecordEvent(self.cap.stream_id(s), ev.id))

    def _wait(self, s: Any, ev: Any) -> None:
        super()._wait(s, ev)
        self.cap.emit(WaitEvent(self.cap.stream_id(s), ev.id))

    def _sync_event(self, ev: Any) -> None:
        super()._sync_event(ev)
        self.cap.emit(HostSync("event", ev.id, "event synchronize"))

    def _sync_stream(self, s: Any) -> None:
        super()._sync_stream(s)
        self.cap.emit(HostSync("stream", self.cap.stream_id(s), "stream synchronize"))

    def synchronize(self, device: Any = None) -> None:
        super().synchronize(device)
        self.cap.emit(HostSync("device", None, "device synchronize"))


class _Capture:
    """The capture's state: storages seen, the items of the measured step (NOTE [ Capture ])."""

    def __init__(self) -> None:
        self.acc: _Accelerator | None = None
        self.fake_mode: FakeTensorMode | None = None
        self.blocks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> _Block
        self.live: dict[int, _Block] = {}  # device and host blocks alive, by id
        self._refs: dict[int, weakref.ref] = {}
        self._next = 1
        self.streams: dict[int, int] = {}  # emulated stream id -> trace stream
        self.stream_names: dict[int, str] = {COMPUTE_STREAM: "compute"}
        self.raw: list[Any] = []  # the measured step's items; Alloc/Free as _Block until settled
        self.recording = False
        self.phase = "other"
        self.pinned = True
        """Host copies are page-locked (``use_pin_memory``)."""
        self.override: str | None = None
        """The category of new storages while set (FSDP2's buffers: NOTE [ One FSDP2 rank ] item 3)."""
        self.state_bytes: dict[str, int] = {}
        """Bytes of the model state one rank holds in the measured step (``Captured.state_bytes``)."""
        self.real_inputs = False
        """Real tensors the step reads (inputs it closes over) become fake ones, counted as device blocks."""
        self.clock: Clock | None = None
        """The modelled device the engine's polls ask in the measured step (NOTE [ Capture ] item 6)."""
        self.device_bytes = 0
        """Bytes of the device blocks alive now (what ``memory_allocated`` reports)."""
        self.device_peak = 0
        self.facts = ModelFacts()

    def as_fake(self, tree: Any) -> Any:
        """``tree`` with every real tensor as its fake twin (memoized by the fake mode, so one real tensor
        is one block for the whole capture); the twin's storage is a device block (``other``), as the
        input of a real step lives on the device (NOTE [ Capture ] item 7)."""
        def conv(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or self.fake_mode is None:
                return t
            f = self.fake_mode.from_tensor(t)
            if self.block_of(f) is None:
                self._new_block(f.untyped_storage(), "other")
            return f
        return pytree.tree_map(conv, tree)

    # -- streams --------------------------------------------------------------------------

    def stream_id(self, s: Any) -> int:
        sid = getattr(s, "id", 0)
        if sid == 0:
            return COMPUTE_STREAM
        out = self.streams.get(sid)
        if out is None:
            out = self.streams[sid] = len(self.streams) + 1
            self.stream_names[out] = f"side {out} ({getattr(s, 'name', '')})"
        return out

    def current_stream(self) -> int:
        return self.stream_id(self.acc.current_stream()) if self.acc is not None else COMPUTE_STREAM

    def emit(self, item: Any) -> None:
        """Record ``item`` (a trace item, or ``("alloc" | "free", block)``) in the measured step."""
        if self.recording:
            self.raw.append(item)
            if self.clock is not None:
                it = settled(item)
                if it is not None:
                    self.clock.add(it)

    # -- storages ---------------------------------------------------------------------------

    def block_of(self, t: torch.Tensor) -> _Block | None:
        try:
            st = local(t).untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None
        return self.blocks.get(st)

    def _new_block(self, st: torch.UntypedStorage, category: str) -> _Block:
        bid = self._next
        self._next += 1
        b = _Block(bid, st.nbytes(), self.current_stream(), current_module_name(), category)
        self.blocks[st] = b
        self.live[bid] = b
        self._refs[bid] = weakref.ref(st, lambda _r, b=b: self._freed(b))
        self.device_bytes += b.nbytes
        self.device_peak = max(self.device_peak, self.device_bytes)
        self.emit(("alloc", b))
        return b

    def resized(self, st: torch.UntypedStorage) -> None:
        """``st`` was resized in place (FSDP2 frees and re-allocates unsharded parameters so): its old
        block is freed and, unless now empty, a new one allocated (NOTE [ One FSDP2 rank ] item 2)."""
        b = self.blocks.get(st)
        if b is None or b.nbytes == st.nbytes():
            return
        if b.alive:
            self._freed(b)
        self._new_block(st, b.category if self.override is None else self.override)

    @contextlib.contextmanager
    def category(self, category: str | None) -> Any:
        """New storages take ``category`` inside the block."""
        prev, self.override = self.override, category
        try:
            yield
        finally:
            self.override = prev

    def _freed(self, b: _Block) -> None:
        b.alive = False
        self.live.pop(b.id, None)
        self._refs.pop(b.id, None)
        if not b.host:
            self.device_bytes -= b.nbytes
        self.emit(("free", b))

    def host_alloc(self, t: torch.Tensor) -> None:
        """A host buffer the engine's pool made (``offload._pinned.HOST_ALLOC_OBSERVERS``)."""
        b = self.block_of(t)
        if b is not None and not b.host:
            b.host = True
            self.device_bytes -= b.nbytes

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        b = self.block_of(t)
        if b is not None and not b.host:
            self.emit(RecordStream(b.id, self.stream_id(stream)))

    def on_output(self, module: nn.Module, output: Any) -> None:
        if self.recording:  # an outermost call returned (OUTPUT_OBSERVERS): NOTE [ Model facts ] item 3
            self.facts.on_output(output, self.mark)

    def mark(self, tensors: list[torch.Tensor], category: str) -> None:
        """Settle the category of the storages behind ``tensors`` (NOTE [ Capture ] item 5)."""
        for t in (leaf for t in tensors for leaf in _leaves(t)):
            b = self.block_of(t)
            if b is not None and not b.host:
                b.category = category

    # -- ops -----------------------------------------------------------------------------------

    def _category(self, t: torch.Tensor | None = None) -> str:
        if self.override is not None:
            return self.override
        if self.phase == "optimizer":
            return "other"
        if current_module_name():
            return "activation"  # the forward, or a forward recomputed in backward
        if self.facts.is_logits(t):
            return "logits"  # NOTE [ Model facts ] item 1
        return "activation" if self.phase == "forward" else "other"

    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        outs = _tensors(out)
        new = []
        for t in outs:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            if st not in self.blocks:
                new.append(self._new_block(st, self._category(t)))
        if not self.recording or func in _METADATA_OPS or func in _EMPTY_OPS or (not new and not _writes(func)):
            return
        ins = _tensors((args, kwargs))
        if func is aten.copy_.default:
            dst, src = self.block_of(args[0]), self.block_of(args[1])
            if dst is not None and src is not None and dst.host != src.host:
                self._copy(dst, src, _nbytes(args[1]))
                return
        dtype = next((t.dtype for t in ins if t.dtype.is_floating_point), None)
        touched = {b.id for t in ins + outs if (b := self.block_of(t)) is not None and not b.host}
        self.emit(Kernel(self.current_stream(), str(func), _flops(func, args, kwargs, out),
                         _io_bytes(ins, outs),
                         dtype, current_module_name(), self._phase(), tuple(sorted(touched))))

    def _copy(self, dst: _Block, src: _Block, nbytes: int) -> None:
        direction = "h2d" if src.host else "d2h"
        dev = dst if src.host else src
        if direction == "h2d":
            dev.category = "copy"
        host = src if src.host else dst
        self.emit(Copy(self.current_stream(), direction, nbytes, self.pinned, current_module_name(),
                       self._phase(), (dev.id,), host.id))

    def _phase(self) -> str:
        if _graph_task_id() >= 0:
            return "backward"
        return self.phase


def _writes(func: Any) -> bool:
    """An op that writes an argument in place (it runs a kernel though it makes no storage)."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _io_bytes(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> int:
    """Bytes an op reads (its tensor arguments) and writes (its outputs that are not arguments)."""
    seen = {id(t) for t in ins}
    return sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs if id(t) not in seen)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _optimizer_state(opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if opt is None:
        return []
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


@contextlib.contextmanager
def _capturing(cap: _Capture, fake: bool, lag: int):
    """The emulated accelerator, fake mode (when ``fake``), the recorder, module tracking and the host
    observer, entered in that order and left in reverse."""
    with contextlib.ExitStack() as stack:
        cap.acc = stack.enter_context(_Accelerator(cap, lag))
        if fake:
            cap.fake_mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=cap.real_inputs))
        stack.enter_context(_CudaOnStandIn())
        stack.enter_context(_Recorder(cap))
        stack.enter_context(track_modules(owner=cap))
        _pinned.HOST_ALLOC_OBSERVERS.append(cap.host_alloc)
        stack.callback(_pinned.HOST_ALLOC_OBSERVERS.remove, cap.host_alloc)
        stack.enter_context(watching_outputs(cap.on_output))
        stack.enter_context(_seeing_resizes(cap))
        yield stack


@contextlib.contextmanager
def _seeing_resizes(cap: _Capture):
    """``UntypedStorage.resize_`` tells the capture (no dispatch mode sees it; torch's MemTracker patches it
    the same way): NOTE [ One FSDP2 rank ] item 2."""
    orig = torch.UntypedStorage.resize_

    def resize_(st: torch.UntypedStorage, size: int) -> Any:
        out = orig(st, size)
        cap.resized(st)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = orig  # type: ignore[method-assign]


def _step(cap: _Capture, model: nn.Module, step_fn: Callable[[nn.Module], torch.Tensor],
          opt: torch.optim.Optimizer | None, autocast: torch.dtype | None = None) -> None:
    """One training step: forward (``step_fn``, under ``autocast``), backward, optimizer step, zero grads."""
    cap.phase = "forward"
    with forward_autocast(autocast):
        loss = step_fn(model)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"offload.predict: step_fn(model) must return the scalar loss, got {loss!r:.80}")
    cap.phase = "backward"
    loss.backward()
    del loss
    cap.mark(_grads(model), "gradient")
    cap.state_bytes = {"parameter": _local_bytes(list(model.parameters())),
                       "buffer": _local_bytes(list(model.buffers())),
                       "gradient": _local_bytes(_grads(model)), "optimizer": 0}
    if opt is not None:
        cap.phase = "optimizer"
        opt.step()
        cap.mark(_optimizer_state(opt), "optimizer")
        cap.state_bytes["optimizer"] = _local_bytes(_optimizer_state(opt))
        opt.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    cap.phase = "other"


def capture(model_fn: Callable[[], nn.Module], step_fn: Callable[[nn.Module], torch.Tensor], *,
            strategy: Any = "none", config: Any = None,
            optimizer: Callable[[Any], torch.optim.Optimizer] | None = None, dtype: torch.dtype | None = None,
            fake: bool = True, lag: int = NEVER, steps: int = 2, real_inputs: bool = False,
            measured: Callable[["_Capture"], Any] | None = None, world_size: int = 1,
            clock: Clock | None = None, mixed_precision: torch.dtype | None = None) -> Captured:
    """Run ``steps`` training steps (NOTE [ Capture ]) and return the last one's trace. ``fake=False``
    runs the same on real CPU tensors (the tests' reference). ``strategy`` may also be a callable
    ``strategy(model) -> Applied``; ``measured(cap)`` a context manager entered around the measured step;
    ``real_inputs``: see NOTE [ Capture ] item 7. ``world_size > 1``: the step of rank 0 of FSDP2 over
    that many GPUs (NOTE [ One FSDP2 rank ] in offload/predict/_fsdp.py). ``clock``: the modelled GPU the
    engine's polls ask in the measured step (NOTE [ Capture ] item 6). ``mixed_precision``: NOTE [ Mixed precision ]."""
    autocast = mixed_precision if world_size == 1 else None
    cap = _Capture()
    cap.clock = clock
    cap.pinned = config.use_pin_memory if config is not None else True
    cap.real_inputs = real_inputs and fake
    with (fake_process_group(world_size) if world_size > 1 else contextlib.nullcontext()) as mesh, \
            _capturing(cap, fake, lag) as stack, cuda_autocast() as autocasts:
        model, param_bytes, block_names = _prepare(cap, stack, model_fn, dtype, fake, mesh, mixed_precision)
        applied = apply_strategy(model, strategy, config)
        try:
            opt = optimizer(model.parameters()) if optimizer is not None else None
            for i in range(steps):
                if i == steps - 1:
                    if applied.engine is not None:
                        applied.engine.ledger.reset()
                    _begin_measured(cap)
                    with measured(cap) if measured is not None else contextlib.nullcontext():
                        _step(cap, model, step_fn, opt, autocast)
                else:
                    _step(cap, model, step_fn, opt, autocast)
            cap.recording = False
            engine = applied.engine
            summary = engine.ledger.summary() if engine is not None else None
            records = [(r.nbytes, r.shape, r.dtype, r.module, r.decision, r.reason, r.tier, r.copy_bytes)
                       for r in engine.ledger.records] if engine is not None else []
            host = _host_bytes(engine)
        finally:
            applied.remove()
    trace = _settle(cap)
    cap.facts.autocast = min(autocasts, key=lambda d: d.itemsize, default=None)
    return Captured(trace, summary, host, param_bytes, block_names, records, dict(cap.state_bytes), cap.facts)


def _prepare(cap: _Capture, stack: contextlib.ExitStack, model_fn: Callable[[], nn.Module], dtype: torch.dtype | None,
             fake: bool, mesh: Any, mixed_precision: torch.dtype | None) -> tuple[nn.Module, int, list[str]]:
    """Build the model, settle its state as ``parameter`` and (with a ``mesh``) shard it: the model, its
    unsharded parameter and buffer bytes, and its candidate blocks."""
    model, twins = _build(model_fn, dtype, fake, stack)
    if twins:  # a model built before the call (or on meta): its real inputs become fake too (item 7)
        cap.real_inputs = cap.fake_mode.allow_non_fake_inputs = True
    if fake:
        _hf_masks_as_real(stack)  # (after the build: the model's import brings masking_utils)
    state = [*model.parameters(), *model.buffers()]
    param_bytes = _local_bytes(state)
    block_names = _block_names(model)
    cap.facts.read(model)
    if mesh is not None:
        shard(model, mesh, block_names, mixed_precision)
        stack.enter_context(fsdp_categories(cap.category, cap.mark))
        state = [*model.parameters(), *model.buffers()]
    cap.mark(state, "parameter")
    return model, param_bytes, block_names


def _begin_measured(cap: _Capture) -> None:
    """Start recording: the blocks alive now open the trace (NOTE [ Capture ] item 4)."""
    cap.raw = []
    cap.recording = True
    for b in sorted(cap.live.values(), key=lambda b: b.id):
        cap.emit(("alloc", b))


def _host_bytes(engine: Any) -> dict[str, int]:
    if engine is None:
        return {"pool": 0, "pageable": 0, "disk": 0}
    st = engine.tiers.stats()
    return {"pool": int(st["pool"]["peak_reserved_bytes"]), "pageable": int(st["pageable"]["peak_in_use_bytes"]),
            "disk": 0}


def _settle(cap: _Capture) -> Trace:
    """The raw items as a ``Trace``: allocations and frees of device blocks with their settled categories."""
    trace = Trace(streams=dict(cap.stream_names))
    for it in cap.raw:
        item = settled(it)
        if item is not None:
            trace.append(item)
    return trace


def settled(it: Any) -> Any:
    """One raw item of a capture as a trace item (None for host memory or an empty request: no device
    block). Categories are read now: settle after the step for the final ones."""
    if type(it) is not tuple:
        return it
    kind, b = it
    if b.host or not b.nbytes:
        return None
    return Alloc(b.id, b.nbytes, b.stream, b.category, b.module) if kind == "alloc" else Free(b.id)


