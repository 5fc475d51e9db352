"""The optimizer in a plan's budget: its state and its step, derived by running a twin of it on fake tensors.

NOTE [ Optimizer in the budget ]
1. What a training step's optimizer adds. Its state stays on the device for the whole step (AdamW: two
   tensors the size of each trainable parameter), and its step allocates temporaries on top of the
   parameters, gradients and state (torch's ``foreach`` implementation, the CUDA default, makes a copy of
   the second moments at once). A budget a user means as "what my card has" must hold both.
2. Derived, not tabled. A twin of the optimizer (its class and its param groups' settings, each parameter
   a fake tensor of the same shape, stride and dtype; a trainable one gets a fake gradient) runs two steps
   under ``FakeTensorMode``: the state after the first is the state (``state_bytes``), the peak of what the
   second allocates is the step's temporaries (``step_bytes``). So any optimizer built like
   ``torch.optim``'s is counted as it is, before its first step too (its state does not exist yet then).
3. As it runs on the device: ``foreach=None`` becomes what torch picks there (True on CUDA, as
   ``torch.optim``'s default does for tensors on a foreach device), unless fused or differentiable.
   Zero-dimensional state (the step count: a host tensor unless capturable or fused) is left out.
4. Measured plans (``offload.plan(..., optimizer=opt)``): state already allocated on an accelerator is in
   the measured peaks (the allocator counts it); the rest (all of it before the first step, and all of it
   on CPU, where the meter counts the model's tensors only) is added to every peak (``charged_bytes``), and
   the step is one more peak: the step's base (parameters, gradients, inputs) plus the state plus
   ``step_bytes``. Target plans: the captures run the twin themselves (``twin_factory``), so the state and
   the step are in every profile and in the verification (``profiled``: nothing is added).
5. Without an optimizer nothing is charged (the step planned for is forward and backward) and the plan's
   report says so in its first line, with what an AdamW would add (``adamw_memory``, derived the same way).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from .._format import format_bytes

__all__ = ["OptimizerMemory", "optimizer_memory", "adamw_memory", "twin_factory", "check_optimizer",
           "with_optimizer", "charged_bytes", "FOREACH_DEVICES"]

FOREACH_DEVICES = ("cuda", "xpu", "mtia")
"""Device types whose tensors torch's optimizers step with ``foreach`` by default (torch.optim's list)."""

OptimizerLike = Any
"""A ``torch.optim.Optimizer`` (or a wrapper holding one as ``.optimizer``: accelerate, Lightning), a
sequence of them, or a factory ``params -> Optimizer`` (as ``offload.predict.predict_step`` takes)."""


@dataclasses.dataclass(frozen=True)
class OptimizerMemory:
    """What an optimizer adds to a training step's device memory (NOTE [ Optimizer in the budget ])."""

    name: str
    """Its class name (several joined by ``+``)."""
    state_bytes: int
    """Device bytes of its state after a step (zero-dimensional state left out)."""
    step_bytes: int
    """Peak bytes its step allocates above the parameters, gradients and state (temporaries)."""
    given: bool = True
    """False: not the user's, what an AdamW would add (``adamw_memory``); nothing is charged."""
    allocated_bytes: int = 0
    """Of ``state_bytes``, what the measured peaks already hold (allocated on an accelerator when planning)."""
    profiled: bool = False
    """The plan's profiles ran it (a target plan's captures): nothing is added to them."""
    foreach: bool = False
    """Its twin stepped with foreach (as torch does on the device)."""

    @property
    def charged_bytes(self) -> int:
        """Bytes added to every peak of the profiled step: the state the profiles did not hold."""
        return 0 if not self.given or self.profiled else max(0, self.state_bytes - self.allocated_bytes)

    @property
    def step_event_bytes(self) -> int:
        """Bytes of the optimizer step's own peak above the step's base and the state (0: not charged here)."""
        return 0 if not self.given or self.profiled else self.step_bytes

    def describe(self) -> str:
        """One line: what it adds and whether the plan holds it (the plan report's first line)."""
        how = f"{format_bytes(self.state_bytes)} of state and {format_bytes(self.step_bytes)} more during its step" + (
            " (foreach, as on the device)" if self.foreach else "")
        if not self.given:
            return (f"optimizer state NOT included: no optimizer= given, so every peak is forward and backward only; "
                    f"an AdamW would add {how} (pass optimizer= to plan for it)")
        if self.profiled:
            where = "run in every predicted step (the captures step a twin of it)"
        elif self.allocated_bytes:
            where = (f"{format_bytes(self.allocated_bytes)} of the state measured on the device, "
                     f"{format_bytes(self.charged_bytes)} added to every peak, its step one more peak")
        else:
            where = "the state added to every peak (not allocated when planned), its step one more peak"
        return f"optimizer {self.name} included: {how}; {where} (derived from a step of its twin on fake tensors)"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "charged_bytes": self.charged_bytes,
                "step_event_bytes": self.step_event_bytes}


def with_optimizer(cost: Any, opt: OptimizerMemory) -> Any:
    """``cost`` (a ``CostModel``) with the step's optimizer: the state the profiles did not hold joins the base
    (every peak), its step is one more peak (``CostModel.breakdown``; item 4)."""
    cost.optimizer = opt
    cost.base += opt.charged_bytes
    return cost


def charged_bytes(cost: Any) -> int:
    """Optimizer state a plan's measured peaks add (not allocated when planned; 0 without ``optimizer=``)."""
    opt = getattr(cost, "optimizer", None)
    return opt.charged_bytes if opt is not None else 0


def check_optimizer(owner: str, optimizer: Any) -> None:
    """An ``optimizer=`` argument is None, an optimizer (or a wrapper of one), a sequence of them, or a
    factory; anything else is refused before any step runs."""
    if optimizer is None or callable(optimizer) and not isinstance(optimizer, (list, tuple)):
        return
    items = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    for o in items:
        if _unwrap(o) is None:
            raise TypeError(
                f"{owner}: optimizer={o!r} ({type(o).__name__}) is not a torch.optim.Optimizer; pass the optimizer "
                "your loop steps (or a list of them, or a factory params -> Optimizer), or None.")


def _unwrap(opt: Any) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` inside a wrapper (accelerate's ``AcceleratedOptimizer``: ``.optimizer``;
    Lightning's ``LightningOptimizer``: ``._optimizer``), or None."""
    for _ in range(4):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(opt, "_optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            opt = inner
            continue
        break
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def _as_on_device(opt: torch.optim.Optimizer, device_type: str) -> bool:
    """Set ``foreach`` where the real optimizer leaves it to torch (None): True on a foreach device, as torch
    resolves it there (NOTE [ Optimizer in the budget ] item 3). Returns whether any group steps with foreach."""
    on = device_type in FOREACH_DEVICES
    for g in opt.param_groups:
        if "foreach" in g and g["foreach"] is None and not g.get("fused") and not g.get("differentiable"):
            g["foreach"] = on
    return any(g.get("foreach") for g in opt.param_groups)


def _twin(opt: torch.optim.Optimizer, fake: Callable[[torch.Tensor], torch.Tensor]) -> torch.optim.Optimizer:
    """``opt``'s class over the fake twins of its parameters, each group with its settings."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fake(p) for p in g["params"]]}
              for g in opt.param_groups]
    cls = type(opt)
    try:
        return cls(groups, **opt.defaults)
    except TypeError:
        try:
            return cls(groups)
        except Exception as e:
            raise ValueError(
                f"offload.plan: cannot build a twin of the optimizer {cls.__name__} to derive its state ({e}); "
                "NOTE [ Optimizer in the budget ] builds type(opt)(param_groups). Pass optimizer= a factory "
                "params -> Optimizer instead.") from None


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                s = v.untyped_storage()
                if id(s) not in seen:
                    seen.add(id(s))
                    total += s.nbytes()
    return total


class _Temporaries(TorchDispatchMode):
    """Peak bytes of the storages the ops run inside it create (views and in-place results are not new;
    zero-dimensional ones left out), each freed when its storage dies."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _freed(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                st = t.untyped_storage()
                if st not in self._seen:
                    n = st.nbytes()
                    self._seen[st] = n
                    weakref.finalize(st, self._freed, n)
                    self.live += n
                    self.peak = max(self.peak, self.live)
        return out


def _run_twin(build: Callable[[Callable[[torch.Tensor], torch.Tensor]], torch.optim.Optimizer],
              device_type: str) -> tuple[int, int, bool]:
    """(state bytes, step temporaries, foreach) of the optimizer ``build(fake)`` makes, stepped twice on fake
    tensors (NOTE [ Optimizer in the budget ] item 2)."""
    memo: dict[int, torch.Tensor] = {}

    def fake(p: torch.Tensor) -> torch.Tensor:
        if id(p) not in memo:
            with torch.no_grad():
                f = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cpu")
            f.requires_grad_(p.requires_grad and p.is_floating_point())
            if f.requires_grad:
                f.grad = torch.zeros_like(f)
            memo[id(p)] = f
        return memo[id(p)]

    with FakeTensorMode(allow_non_fake_inputs=True):
        twin = build(fake)
        foreach = _as_on_device(twin, device_type)
        twin.step()
        state = _state_bytes(twin)
        with _Temporaries() as temps:
            twin.step()
        return state, temps.peak, foreach


def _optimizers(optimizer: OptimizerLike) -> list[torch.optim.Optimizer]:
    items = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    out = []
    for o in items:
        inner = _unwrap(o)
        if inner is None:
            check_optimizer("offload.plan", o)  # raises, naming it
        out.append(inner)
    return out


def _is_factory(optimizer: Any) -> bool:
    return callable(optimizer) and not isinstance(optimizer, (list, tuple)) and _unwrap(optimizer) is None


def optimizer_memory(optimizer: OptimizerLike, model: nn.Module, device: torch.device, *,
                     profiled: bool = False) -> OptimizerMemory:
    """What ``optimizer`` adds to a step of ``model`` on ``device`` (NOTE [ Optimizer in the budget ]);
    ``profiled``: the plan's captures run it (a target plan)."""
    if _is_factory(optimizer):
        params = list(model.parameters())
        state, step, foreach = _run_twin(lambda fake: optimizer([fake(p) for p in params]), device.type)
        return OptimizerMemory(_factory_name(optimizer, model), state, step, profiled=profiled, foreach=foreach)
    opts = _optimizers(optimizer)
    state = step = 0
    foreach = False
    for opt in opts:
        s, t, f = _run_twin(lambda fake, o=opt: _twin(o, fake), device.type)
        state, step, foreach = state + s, max(step, t), foreach or f
    allocated = 0
    if device.type != "cpu" and not profiled:  # the allocator counts what exists (item 4)
        allocated = sum(_state_bytes_on(o, device) for o in opts)
    return OptimizerMemory("+".join(type(o).__name__ for o in opts), state, step, allocated_bytes=min(allocated, state),
                           profiled=profiled, foreach=foreach)


def _state_bytes_on(opt: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes of ``opt``'s existing state on ``device`` (zero-dimensional state left out)."""
    return sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device.type == device.type)


def _factory_name(factory: Callable[..., Any], model: nn.Module) -> str:
    """The class a factory builds (built on meta twins of one parameter: nothing allocated)."""
    p = next((q for q in model.parameters() if q.requires_grad), None)
    if p is None:
        return getattr(factory, "__name__", "optimizer")
    try:
        return type(factory([torch.empty(p.shape, dtype=p.dtype, device="meta", requires_grad=True)])).__name__
    except Exception:
        return getattr(factory, "__name__", "optimizer")


def adamw_memory(model: nn.Module, device: torch.device) -> OptimizerMemory:
    """What ``torch.optim.AdamW`` over ``model``'s trainable parameters would add on ``device`` (not charged:
    the report's first line of a plan made without ``optimizer=``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return OptimizerMemory("AdamW", 0, 0, given=False)
    state, step, foreach = _run_twin(lambda fake: torch.optim.AdamW([fake(p) for p in params]), device.type)
    return OptimizerMemory("AdamW", state, step, given=False, foreach=foreach)


def twin_factory(optimizer: OptimizerLike, model: nn.Module, device_type: str = "cuda"
                 ) -> Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]:
    """A factory for ``offload.predict``'s capture: given the (fake) parameters of ``model`` in
    ``model.parameters()`` order, the user's optimizer(s) over them, each group with its settings, stepping
    with foreach where torch would on ``device_type`` (NOTE [ Optimizer in the budget ] item 4)."""
    if _is_factory(optimizer):
        def build_factory(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
            opt = optimizer(params)
            _as_on_device(opt, device_type)
            return opt

        return build_factory
    opts = _optimizers(optimizer)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    missing = [p for o in opts for g in o.param_groups for p in g["params"] if id(p) not in index]
    if missing:
        raise ValueError(f"offload.plan: optimizer= holds {len(missing)} parameter(s) that are not the model's "
                         f"(first of shape {tuple(missing[0].shape)}); pass the optimizer of this model.")

    def build(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        fakes = list(params)
        twins = [_twin(o, lambda p: fakes[index[id(p)]]) for o in opts]
        for t in twins:
            _as_on_device(t, device_type)
        return twins[0] if len(twins) == 1 else _Several(twins)  # type: ignore[return-value]

    return build


class _Several:
    """Several optimizers stepped as one (Lightning's list of optimizers), for a capture that steps one: the
    capture calls ``step()`` and ``zero_grad()`` and reads ``state``."""

    def __init__(self, opts: Sequence[torch.optim.Optimizer]) -> None:
        self.opts = list(opts)

    @property
    def state(self) -> dict:
        return {k: v for o in self.opts for k, v in o.state.items()}

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)
