"""The tiled loss: cross-entropy of a linear head's logits, computed in tiles of tokens so the full
``tokens x vocabulary`` logits never exist (NOTE [ Tiles ] in offload/tiling.py).

``cross_entropy_tiles`` picks the implementation: on a CUDA tensor, Liger-Kernel's fused linear
cross-entropy when it is installed, else Apple's cut-cross-entropy when installed, else the built-in tiles
(``TiledLinearCrossEntropy``, any device). The built-in forward keeps per token only the log-sum-exp
(4 bytes); backward recomputes each tile's logits and forms ``softmax - one_hot`` from it, so at most one
tile's float32 logits are alive at a time, in either pass.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._tiled_mlp import AutocastState, tile_slices
from .errors import OffloadError

__all__ = ["LOSS_IMPLS", "TiledLinearCrossEntropy", "cross_entropy_tiles", "select_loss_impl",
           "default_loss_rows", "loss_bytes_not_saved"]

log = logging.getLogger("offload.tiling")

LOSS_IMPLS = ("auto", "builtin", "liger", "cut_cross_entropy")
"""``impl=`` choices: ``auto`` (a fused CUDA kernel when one is installed and the tensors are on CUDA, else
``builtin``), the built-in tiles, or one library by name (raises when it is not importable)."""

_EXTERNAL = {
    "liger": ("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy"),
    "cut_cross_entropy": ("cut_cross_entropy", "linear_cross_entropy"),
}
"""Library -> (module, function): Liger-Kernel's fused linear cross-entropy, cut-cross-entropy's."""

LOSS_TILE_BYTES = 256 << 20
"""The most float32 logits a loss tile holds by default (``tokens=None``): 256 MiB, 523 tokens of a
128,256-token vocabulary."""


def default_loss_rows(vocab: int, hidden: int, tokens: int) -> int:
    """Tokens per loss tile by default: as many as make a tile's logits no more than all the hidden states
    (``tokens x hidden / vocab``, Liger-Kernel's rule), and at most ``LOSS_TILE_BYTES`` of float32 logits;
    at least 64 (a matmul that short is already inefficient)."""
    return max(64, min(-(-tokens * hidden // vocab), LOSS_TILE_BYTES // (4 * vocab)))


def loss_bytes_not_saved(rows: int, vocab: int) -> int:
    """What tiling spares, over ``rows`` tokens: the float32 log-probabilities cross-entropy on full logits
    saves for backward (``rows x vocab x 4``), less the per-token log-sum-exp the tiles keep instead."""
    return rows * vocab * 4 - rows * 4


def _import(name: str) -> Callable[..., torch.Tensor] | None:
    module, fn = _EXTERNAL[name]
    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError):
        return None


def select_loss_impl(impl: str, device_type: str) -> tuple[str, Callable[..., torch.Tensor] | None]:
    """(name, the library's function or None for ``builtin``) for ``impl`` on tensors of ``device_type``."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"offload.tiling: impl={impl!r} is not one of {LOSS_IMPLS}")
    if impl == "builtin":
        return "builtin", None
    if impl != "auto":
        fn = _import(impl)
        if fn is None:
            module = _EXTERNAL[impl][0].split(".")[0]
            raise ImportError(f"offload.tiling: impl={impl!r}, but {module} is not importable here; install it "
                              "(a CUDA GPU with Triton) or pass impl='auto' (it falls back to the built-in tiles).")
        return impl, fn
    if device_type == "cuda":
        for name in _EXTERNAL:
            fn = _import(name)
            if fn is not None:
                return name, fn
    return "builtin", None


class _CERun:
    """One tiled loss call: what forward and backward share (ctx holds it)."""

    def __init__(self, rows: int, ignore_index: int, record: Callable[[int, int], None] | None,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.rows = rows
        self.ignore_index = ignore_index
        self.record = record
        self.transform = transform
        """What the model does to its logits before the loss (an elementwise ``Replay``), or None."""
        self.compute_dtype: torch.dtype | None = None
        self.autocast: AutocastState | None = None
        """Forward's autocast state, under which backward replays ``transform`` (the same values)."""

    def forward(self, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the token losses over labelled tokens, float32; per-token log-sum-exp, float32)."""
        n = h.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        self.autocast = AutocastState(h.device.type)
        for sl in tile_slices(n, self.rows):
            logits = F.linear(h[sl], w, b)  # (t, V), autocast as in the untiled head
            self.compute_dtype = logits.dtype
            lf = (logits if self.transform is None else self.transform(logits)).float()
            lse[sl] = torch.logsumexp(lf, dim=-1)
            yi = y[sl]
            valid = yi != self.ignore_index
            picked = lf.gather(1, torch.where(valid, yi, 0).unsqueeze(1)).squeeze(1)
            total += torch.where(valid, lse[sl] - picked, 0.0).sum()
        return total, lse

    def _mapped(self, z: torch.Tensor) -> torch.Tensor:
        """``transform(z)`` in float32, recorded by autograd from ``z`` (made a leaf that wants a gradient),
        under the forward's autocast state: the values forward's log-sum-exp was taken of."""
        z.requires_grad_()
        with torch.enable_grad(), self.autocast.restored():
            return self.transform(z).float()

    def backward(self, g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor,
                 lse: torch.Tensor, need: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, ...]:
        """(d hidden, d weight, d bias): each tile's logits recomputed, ``softmax - one_hot`` scaled by ``g``."""
        cdt = self.compute_dtype
        wc, bc = w.to(cdt), (b.to(cdt) if b is not None else None)
        dh = torch.empty_like(h) if need[0] else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need[1] else None
        db = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if need[2] and b is not None else None
        with torch.autocast(h.device.type, enabled=False):
            for sl in tile_slices(h.shape[0], self.rows):
                hc = h[sl].to(cdt)
                z = F.linear(hc, wc, bc)
                zt = z.float() if self.transform is None else self._mapped(z)
                p = torch.exp(zt.detach() - lse[sl, None])  # softmax, (t, V) float32
                yi = y[sl]
                valid = yi != self.ignore_index
                p.scatter_add_(1, torch.where(valid, yi, 0).unsqueeze(1), torch.full_like(lse[sl, None], -1.0))
                p.mul_((valid * g).unsqueeze(1))
                d = p.to(cdt) if self.transform is None else torch.autograd.grad(zt, z, p)[0]
                if dh is not None:
                    dh[sl] = d @ wc
                if dw is not None and cdt == torch.float32:
                    dw.addmm_(d.t(), hc)  # (V, H) summed in place, no tile-sized temporary
                elif dw is not None:
                    dw.add_(d.t() @ hc)  # one tile's (V, H) in the compute dtype, summed in float32
                if db is not None:
                    db.add_(d.sum(0))
        if self.record is not None:
            self.record(loss_bytes_not_saved(h.shape[0], w.shape[0]), -(-h.shape[0] // self.rows))
        return (dh, dw.to(w.dtype) if dw is not None else None,
                db.to(b.dtype) if db is not None else None)


class TiledLinearCrossEntropy(torch.autograd.Function):
    """Sum over labelled tokens of ``cross_entropy(hidden @ weight.T + bias, targets)``, in tiles:
    inputs (run, hidden (N, H), weight (V, H), bias (V,) or None, targets (N,))."""

    @staticmethod
    def forward(ctx: Any, run: _CERun, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                y: torch.Tensor) -> torch.Tensor:
        total, lse = run.forward(h, w, b, y)
        ctx.run, ctx.has_bias = run, b is not None
        ctx.save_for_backward(h, w, b if b is not None else h.new_empty(0), y, lse)
        return total

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, w, b, y, lse = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[1:4])
        dh, dw, db = ctx.run.backward(g, h, w, b if ctx.has_bias else None, y, lse, need)
        return None, dh, dw, db, None


class _RecordOnBackward(torch.autograd.Function):
    """Identity on a library's loss whose backward records the call (as the built-in tiles do in theirs)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, record: Callable[[], None]) -> torch.Tensor:
        ctx.record = record
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.record()
        return g, None


def _weight_bias(head: nn.Module | torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(head, torch.Tensor):
        return head, bias
    if type(head).forward is not nn.Linear.forward:
        raise TypeError(f"offload.tiling.linear_cross_entropy: head must be an nn.Linear (or its weight tensor), "
                        f"got {type(head).__name__}, whose forward is not a plain linear map (a LoRA-wrapped head "
                        "is one: leave the head out of the adapter's target modules to tile the loss).")
    if bias is not None:
        raise TypeError("offload.tiling.linear_cross_entropy: pass bias= only with a weight tensor; an nn.Linear "
                        "head brings its own.")
    return head.weight, head.bias


def cross_entropy_tiles(hidden: torch.Tensor, head: nn.Module | torch.Tensor, targets: torch.Tensor, *,
                        bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                        tokens: int | None = None, impl: str = "auto",
                        record: Callable[[str, int, int], None] | None = None,
                        transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``F.cross_entropy(head(hidden).float(), targets, ignore_index=..., reduction=...)`` without the full
    logits: ``hidden`` (..., H) is the head's input, ``head`` an ``nn.Linear`` or its weight (V, H),
    ``targets`` (...) class indices (``ignore_index`` ones left out). ``reduction``: "mean" over the
    labelled tokens or "sum". ``tokens``: tokens per tile (default: ``default_loss_rows``).
    ``impl``: see ``LOSS_IMPLS``. ``record(impl, bytes_not_saved, tiles)`` is called once per backward.
    ``transform``: an elementwise map of the logits before the loss (``offload._logits_watch.Replay``: a
    model's soft-cap or scale), applied to each tile by the built-in tiles (``impl="auto"`` picks them)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"offload.tiling.linear_cross_entropy: reduction={reduction!r} must be 'mean' or 'sum'")
    w, b = _weight_bias(head, bias)
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"offload.tiling.linear_cross_entropy: {h.shape[0]} tokens of hidden states "
                         f"(hidden {tuple(hidden.shape)}) but {y.shape[0]} targets (targets {tuple(targets.shape)})")
    rows = default_loss_rows(w.shape[0], w.shape[1], h.shape[0]) if tokens is None else _positive("tokens", tokens)
    if transform is not None and impl not in ("auto", "builtin"):
        raise OffloadError(f"offload.tiling: impl={impl!r} computes cross-entropy of the head's output as it is, "
                           f"but the model maps its logits first ({transform!r}); pass impl='auto' or 'builtin' "
                           "(the built-in tiles apply the map to each tile).")
    name, fn = select_loss_impl(impl, h.device.type) if transform is None else ("builtin", None)
    if fn is not None:
        if torch.is_autocast_enabled(h.device.type):  # the kernels take one dtype: the head's, under autocast
            cdt = torch.get_autocast_dtype(h.device.type)
            h, w, b = h.to(cdt), w.to(cdt), (b.to(cdt) if b is not None else None)
        total = fn(h, w, y, bias=b, ignore_index=ignore_index, reduction="sum")
        if record is not None:
            total = _RecordOnBackward.apply(total, lambda: record(
                name, loss_bytes_not_saved(h.shape[0], w.shape[0]), 1))
    else:
        run = _CERun(rows, ignore_index, (lambda nbytes, tiles: record(name, nbytes, tiles)) if record else None,
                     transform)
        total = TiledLinearCrossEntropy.apply(run, h, w, b, y)
    if reduction == "sum":
        return total
    return total / (y != ignore_index).sum()


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"offload.tiling: {name}={value!r} must be a positive number of tokens per tile")
    return value
