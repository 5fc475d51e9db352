"""What a causal LM does to its logits between its output head and its loss, seen while ``tile_loss``
runs it, and replayed on each tile of logits (offload/tiling.py, NOTE [ Tiles ] item 2).

Several models transform the head's output before the loss: Gemma 2 and 3 soft-cap it
(``c * tanh(z / c)``), Granite divides it by ``config.logits_scaling``, Cohere multiplies it by
``config.logit_scale``, Falcon-H1 by ``lm_head_multiplier``. The tiles compute the loss from the head's
input, so they must apply the same transform to each tile's logits, or the loss and every gradient
differ with no error.

A list of configuration keys cannot know every model, so the transform is read off the model's own
code as it runs: ``LogitsWatch`` is a torch-function mode, entered when the swapped head returns its
stand-in for the logits (zero-width: the full logits never exist) and left when the model calls its
loss. While it is entered it notes each op whose arguments hold the stand-in or a tensor made from it
(the ops between head and loss: a few, so nothing else of the step pays for it). ``transform`` reads
the notes behind the tensor the model hands its loss:

* only casts (``float``, ``to``, ``contiguous``): ``None``, the tiles as they are;
* a chain of elementwise ops whose other operands are numbers or one-element tensors that need no
  gradient: a ``Replay`` of that chain, which the tiles apply to each tile's logits in forward and
  backward (where autograd takes the gradient through it);
* anything else (an op that is not elementwise, an operand with a shape or a gradient of its own, an
  in-place op, a tensor not made from the head's output): an ``OffloadError`` that names the op, raised
  before any loss is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from numbers import Number
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_leaves

from ._torch_private import function_modes
from .errors import OffloadError

__all__ = ["LogitsWatch", "Replay"]

_T = torch.Tensor
_CASTS = frozenset((_T.float, _T.double, _T.half, _T.bfloat16, _T.to, _T.type_as, _T.contiguous))
"""Ops that change no value the loss reads (a dtype or a layout): a chain of only these is the identity."""
_ELEMENTWISE = _CASTS | frozenset((
    torch.mul, torch.multiply, torch.div, torch.divide, torch.true_divide, torch.add, torch.sub, torch.subtract,
    torch.neg, torch.tanh, torch.clamp, torch.clip, torch.sigmoid, torch.exp, torch.log, torch.sqrt, torch.abs,
    _T.mul, _T.multiply, _T.div, _T.divide, _T.true_divide, _T.add, _T.sub, _T.subtract, _T.neg, _T.tanh,
    _T.clamp, _T.clip, _T.sigmoid, _T.exp, _T.log, _T.sqrt, _T.abs,
    _T.__mul__, _T.__rmul__, _T.__truediv__, _T.__rtruediv__, _T.__add__, _T.__radd__, _T.__sub__,
    _T.__rsub__, _T.__neg__,
))
"""Ops applied to each logit alone: on a tile of logits they compute what they compute on the whole."""


@dataclass(frozen=True, slots=True)
class _Step:
    """One op that made a watched tensor: ``func(*args, **kwargs)``, ``parent`` (the watched tensor among
    its arguments, None for the head's stand-in itself), ``why_not`` (what the tiles cannot replay about it,
    or about an earlier step; "" when they can)."""

    func: Callable[..., Any] | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    parent: torch.Tensor | None
    why_not: str


def _operand_problem(name: str, value: Any) -> str:
    """Why a non-logits operand of an elementwise op cannot be replayed on tiles ("" when it can)."""
    if isinstance(value, _T):
        if value.numel() != 1:
            return f"{name} with a tensor of shape {tuple(value.shape)}"
        if value.requires_grad:
            return f"{name} with a trainable operand (the tiles do not compute its gradient)"
        return ""
    if value is None or isinstance(value, (Number, str, torch.dtype, torch.device, torch.memory_format)):
        return ""
    return f"{name} with a {type(value).__name__} operand"


class LogitsWatch(TorchFunctionMode):
    """Notes the ops applied to the head's stand-ins (``start``) and to what is made from them."""

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[int, tuple[torch.Tensor, _Step]] = {}
        """id -> (a watched tensor, the step that made it): the tensor held, so its id stays its own."""

    def start(self, stand_in: torch.Tensor) -> None:
        """Watch ``stand_in`` (the head's zero-width output) and what the model makes from it; the mode is
        entered at the first call."""
        if not self.entered():
            self.__enter__()
        self._made[id(stand_in)] = (stand_in, _Step(None, (), {}, None, ""))

    def entered(self) -> bool:
        return any(m is self for m in function_modes())

    def stop(self) -> None:
        """Watch nothing more, and leave the mode where it is the innermost one (else ``stop`` again once
        the modes entered inside it have been left: until then it only passes calls through)."""
        self._made.clear()
        modes = function_modes()
        if modes and modes[-1] is self:
            self.__exit__(None, None, None)

    def _step_of(self, t: Any) -> _Step | None:
        got = self._made.get(id(t)) if isinstance(t, _T) else None
        return got[1] if got is not None and got[0] is t else None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self._made:
            return func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs))  # (torch.cat([a, b]) holds its tensors in a list)
        parents = [a for a in leaves if self._step_of(a) is not None]
        if not parents:
            return func(*args, **kwargs)
        name = resolve_name(func) or repr(func)
        try:
            out = func(*args, **kwargs)
        except Exception as e:  # (an operand shaped like the full logits: it cannot meet the stand-in)
            raise OffloadError(
                f"offload.tiling.tile_loss: the model's {name} on its logits failed on tile_loss's stand-in for "
                f"them (zero-width: the tiles never make the full logits): {str(e).rstrip('.')}. Leave the loss untiled for this "
                "model (tiled_loss=False in offload.long_context).") from e
        if not isinstance(out, _T):  # a read (shape, dtype, size()): no new logits
            return out
        if self._step_of(out) is not None:
            if func not in _CASTS:  # (a cast that changes nothing returns the tensor itself: .float() of float32)
                self._made[id(out)] = (out, _Step(func, args, kwargs, None, f"{name} (in place)"))
            return out
        if len({id(p) for p in parents}) > 1 or sum(a is parents[0] for a in leaves) > 1:
            why = f"{name} of the logits with themselves"
        elif func not in _ELEMENTWISE:
            why = name
        else:
            why = self._step_of(parents[0]).why_not or next(
                (p for p in (_operand_problem(name, a) for a in leaves if a is not parents[0]) if p), "")
        self._made[id(out)] = (out, _Step(func, args, kwargs, parents[0], why))
        return out

    def transform(self, logits: Any, model: str) -> "Replay | None":
        """What ``model`` did to the head's output to make ``logits`` (the tensor it passed its loss):
        None (the identity, up to casts), a ``Replay``, or an ``OffloadError`` naming what the tiles
        cannot replay."""
        step = self._step_of(logits)
        if step is None:
            raise OffloadError(
                f"offload.tiling.tile_loss: {model} passed its loss logits that were not computed from its "
                "output head's result by elementwise ops, so the tiles cannot reproduce its loss. Leave the "
                "loss untiled for this model (tiled_loss=False in offload.long_context).")
        if step.why_not:
            raise OffloadError(
                f"offload.tiling.tile_loss: {model} applies {step.why_not} to its logits before its loss; the "
                "tiles replay only elementwise ops whose other operands are numbers or one-element tensors "
                "without a gradient (scaling, soft-capping), so they would change the loss. Leave the loss "
                "untiled for this model (tiled_loss=False in offload.long_context).")
        steps = []
        while step.func is not None:
            steps.append(step)
            step = self._step_of(step.parent)
        if all(s.func in _CASTS for s in steps):
            return None
        return Replay(tuple(reversed(steps)))


class Replay:
    """A model's elementwise transform of its logits, as recorded: applied to one tile of logits at a time."""

    def __init__(self, steps: tuple[_Step, ...]) -> None:
        self._steps = steps
        self.names = tuple(resolve_name(s.func) or repr(s.func) for s in steps)
        """The ops, in order (for logs and errors)."""

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        for s in self._steps:
            if s.func is _T.contiguous:  # a layout: nothing a tile needs
                continue
            if s.func is _T.to:  # the dtype alone (a device would move the tile off the hidden states')
                dtype = next((a for a in (*s.args, *s.kwargs.values()) if isinstance(a, torch.dtype)), None)
                z = z if dtype is None else z.to(dtype)
                continue
            z = s.func(*(z if a is s.parent else a for a in s.args),
                       **{k: z if v is s.parent else v for k, v in s.kwargs.items()})
        return z

    def __repr__(self) -> str:
        return f"Replay({', '.join(self.names)})"
