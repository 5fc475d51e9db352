"""The tiled MLP's autograd Function: a per-token module run over the sequence in tiles, recomputed in
backward one tile at a time (NOTE [ Tiles ] in offload/tiling.py).

Forward runs the tiles without autograd and writes each tile's output into one output tensor; only the
input is saved. Backward recomputes each tile with autograd on (the forward's RNG and autocast state
restored) on detached aliases of the parameters, takes the tile's input and alias gradients with
``torch.autograd.grad``, sums the parameter gradients over the tiles in float32 and returns them: each
parameter gets one gradient per backward through this node, as from an untiled module (its hooks, DDP's
and FSDP's included, fire once; ``torch.autograd.grad(loss, params)`` works).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .errors import OffloadError
from .policy import storage_ptr

__all__ = ["MLPRun", "TiledMLP", "tile_slices", "AutocastState", "RngState"]


def tile_slices(n: int, rows: int) -> Iterator[slice]:
    """``slice``s of ``rows`` items covering ``range(n)`` in order (the last one may be shorter)."""
    for start in range(0, n, rows):
        yield slice(start, min(n, start + rows))


class AutocastState:
    """The autocast state (enabled, dtype) of a device type and of the CPU, taken at forward, re-entered
    in backward (autograd runs backward outside the forward's autocast region)."""

    def __init__(self, device_type: str) -> None:
        types = dict.fromkeys((device_type, "cpu"))
        self.states = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in self.states:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield


class RngState:
    """The CPU generator's state and the accelerator's, taken before the first tile's forward: backward
    replays the tiles in the same order from it, so dropout inside the module draws the forward's masks."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        mod = getattr(torch, device.type, None) if device.type not in ("cpu", "meta") else None
        self.device = device if mod is not None and hasattr(mod, "get_rng_state") else None
        self.dev_state = mod.get_rng_state(device) if self.device is not None else None

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        devices = [self.device] if self.device is not None else []
        kind = self.device.type if self.device is not None else "cuda"
        with torch.random.fork_rng(devices=devices, device_type=kind):
            torch.set_rng_state(self.cpu)
            if self.device is not None:
                getattr(torch, self.device.type).set_rng_state(self.dev_state, self.device)
            yield


def _static(t: torch.Tensor, params: list[nn.Parameter], ptrs: set[int], shapes: set[tuple[int, ...]]) -> bool:
    """Whether a tensor the recompute saved is a parameter, a view or cast of one (autocast's), not an
    activation: its storage is a parameter's, or its history is a chain of one-input ops from a
    parameter's ``AccumulateGrad``, or (no history: a frozen parameter's cast) it is 2-D with a
    parameter's shape or its transpose."""
    if storage_ptr(t) in ptrs:
        return True
    fn = t.grad_fn
    if fn is None:
        return t.dim() == 2 and (tuple(t.shape) in shapes or tuple(t.shape[::-1]) in shapes)
    for _ in range(16):
        if type(fn).__name__ == "AccumulateGrad":
            return any(fn.variable is p for p in params)
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


class MLPRun:
    """One tiled call of a per-token module: what forward and backward share (ctx holds it)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], module: nn.Module, rows: int,
                 params: list[nn.Parameter], record: Callable[[int, int], None] | None) -> None:
        self.fn = fn
        self.module = module
        self.rows = rows
        self.params = params
        """The module's parameters that require grad, in the order they were passed to ``TiledMLP``."""
        self.record = record
        self.rng: RngState | None = None
        self.autocast: AutocastState | None = None
        self.mutated: list[str] = []
        """The module's buffers its forward tiles wrote or replaced (a counter of tokens per expert):
        backward's recompute leaves them as the forward did (``_buffers_kept``)."""

    def _check(self, y: Any, rows: int) -> torch.Tensor:
        if not isinstance(y, torch.Tensor) or y.dim() != 3 or y.shape[1] != rows:
            got = type(y).__name__ if not isinstance(y, torch.Tensor) else f"a tensor of shape {tuple(y.shape)}"
            raise OffloadError(
                f"offload.tiling.tile_mlp: {type(self.module).__name__} returned {got} for an input of shape "
                f"(1, {rows}, hidden); a tiled module must map each token on its own and return one tensor with "
                "the tokens where it took them (an MLP does; a mixture of experts that also returns router "
                "logits does not). Pass modules=[...] naming only per-token modules.")
        return y

    def _check_owned(self, y: torch.Tensor, owned: list[torch.Tensor]) -> None:
        """Refuse a module that computes with a tensor needing a gradient that it does not own (a parameter
        of another module, kept as a plain attribute): its gradient would be lost (``_outside_leaves``)."""
        outside = _outside_leaves(y, owned)
        if outside:
            shapes = ", ".join(str(tuple(t.shape)) for t in outside[:3])
            raise OffloadError(
                f"offload.tiling.tile_mlp: {type(self.module).__name__} computes with {len(outside)} tensor(s) "
                f"needing a gradient that are neither its parameters nor its input (shapes {shapes}: another "
                "module's parameter kept as a plain attribute, a tensor from outside); the tiles differentiate the "
                "module's own parameters and its input, so those would get no gradient. Register them on the "
                "module, or leave it untiled (tiled_mlp=False).")

    def forward_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """The module over ``x`` (``(..., hidden)``) tile by tile, without autograd: ``(..., out)``."""
        self.rng, self.autocast = RngState(x.device), AutocastState(x.device.type)
        x3 = x.reshape(1, -1, x.shape[-1])  # (1, N, H): tiles keep a batch dimension
        out = out3 = None
        before = {n: (b, b._version) for n, b in self.module.named_buffers()}
        with torch.no_grad():
            for sl in tile_slices(x3.shape[1], self.rows):
                y = self._check(self.fn(x3[:, sl]), sl.stop - sl.start)  # (1, t, H_out)
                if out is None:  # the output in x's shape, written through a (1, N, H_out) view: returned
                    out = y.new_empty((*x.shape[:-1], y.shape[-1]))  # as it is, not a view, so the model may
                    out3 = out.view(1, x3.shape[1], y.shape[-1])  # add into it in place (Falcon's blocks do)
                out3[:, sl] = y
        after = dict(self.module.named_buffers())
        self.mutated = [n for n, (b, v) in before.items() if after.get(n) is not b or b._version != v]
        return out

    def backward_tiles(self, x: torch.Tensor, grad: torch.Tensor, need_x: bool,
                       need: tuple[bool, ...]) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Recompute each tile and return (d input, [d param] in ``params`` order, float32-summed)."""
        x3 = x.reshape(1, -1, x.shape[-1])
        g3 = grad.reshape(1, x3.shape[1], -1)
        wanted = [p for p, n in zip(self.params, need) if n]
        dx = torch.empty_like(x3) if need_x else None
        acc: list[torch.Tensor | None] = [None] * len(wanted)
        counter = _SavedBytes(self.module, x3)
        with self.rng.restored(), self.autocast.restored(), torch.enable_grad(), \
                _aliased(self.module, wanted) as leaves, _buffers_kept(self.module, self.mutated):
            counter.params += leaves
            for sl in tile_slices(x3.shape[1], self.rows):
                xi = x3[:, sl].detach().requires_grad_(need_x)
                with counter.counting():
                    yi = self.fn(xi)
                if sl.start == 0:
                    self._check_owned(yi, [xi, *leaves, *self.module.parameters()])
                grads = torch.autograd.grad(yi, ([xi] if need_x else []) + leaves, g3[:, sl], allow_unused=True)
                if need_x:
                    dx[:, sl] = grads[0] if grads[0] is not None else 0
                _accumulate(acc, grads[1:] if need_x else grads, g3)
        if self.record is not None:
            self.record(counter.nbytes, -(-x3.shape[1] // self.rows))
        out = iter(None if a is None else a.to(p.dtype) for a, p in zip(acc, wanted))
        return (dx.view_as(x) if dx is not None else None), [next(out) if n else None for n in need]


def _outside_leaves(y: torch.Tensor, owned: list[torch.Tensor], limit: int = 100_000) -> list[torch.Tensor]:
    """Tensors with a gradient of their own that ``y``'s graph reaches besides ``owned`` (the tile's input and
    the module's parameter aliases): the tiles take gradients for ``owned`` alone, so these would get none.
    Walks at most ``limit`` nodes (a tile's graph has tens)."""
    ids = {id(t) for t in owned}
    seen, todo, outside = set(), [y.grad_fn], []
    while todo and len(seen) < limit:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # an AccumulateGrad: a leaf that wants a gradient
        if var is not None:
            if id(var) not in ids:
                outside.append(var)
            continue
        todo.extend(f for f, _ in fn.next_functions)
    return outside


@contextlib.contextmanager
def _buffers_kept(module: nn.Module, names: list[str]) -> Iterator[None]:
    """Undo, on leaving, what the recompute does to the buffers ``names`` of ``module`` (those its forward
    changed): the forward's tiles updated them once, as the untiled module would; the recompute must not
    update them again."""
    if not names:
        yield
        return
    kept = {n: module.get_buffer(n) for n in names}
    values = {n: b.detach().clone() for n, b in kept.items()}
    try:
        yield
    finally:
        for n, b in kept.items():
            owner, _, leaf = n.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = b  # (the same object, where the recompute replaced it)
            with torch.no_grad():
                b.copy_(values[n])


@contextlib.contextmanager
def _aliased(module: nn.Module, params: list[nn.Parameter]) -> Iterator[list[torch.Tensor]]:
    """While inside, ``module`` computes with a detached alias of each of ``params`` (same storage, a leaf
    of its own): the tiles' ``torch.autograd.grad`` then differentiates the aliases, so no hook on a
    parameter sees a tile's partial gradient; the summed gradient reaches the parameter once, through the
    tiled node's output. Yields the aliases in ``params`` order."""
    alias = {id(p): p.detach().requires_grad_(True) for p in params}
    slots = [(m, k, p) for m in module.modules() for k, p in m._parameters.items()
             if p is not None and id(p) in alias]
    for m, k, p in slots:
        m._parameters[k] = alias[id(p)]
    try:
        yield [alias[id(p)] for p in params]
    finally:
        for m, k, p in slots:
            m._parameters[k] = p


def _accumulate(acc: list[torch.Tensor | None], grads: tuple[torch.Tensor | None, ...], grad_out: torch.Tensor) -> None:
    """Add each tile's parameter gradient into its float32 sum (the first float32 one is summed into in
    place, unless it is the incoming gradient itself, which autograd may pass through for a parameter
    shaped like the output)."""
    for i, g in enumerate(grads):
        if g is None:
            continue
        if acc[i] is None:
            shared = storage_ptr(g) == storage_ptr(grad_out)
            acc[i] = g.float() if g.dtype != torch.float32 else (g.clone() if shared else g)
        else:
            acc[i].add_(g)


class _SavedBytes:
    """Counts the bytes a tile's recompute saves for backward that are activations (not the tile's input,
    a parameter, or a view or cast of one): what the untiled module saves from forward to backward."""

    def __init__(self, module: nn.Module, x: torch.Tensor) -> None:
        self.params = list(module.parameters())
        self.ptrs = {storage_ptr(p) for p in self.params} | {storage_ptr(x)}
        self.shapes = {tuple(p.shape) for p in self.params}
        self.seen: set[int] = set()
        self.nbytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_ptr(t)
        if key not in self.seen and not _static(t, self.params, self.ptrs, self.shapes):
            self.seen.add(key)  # a storage saved twice in one tile (x and its view) counts once
            self.nbytes += t.untyped_storage().nbytes()
        return t

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.seen = set()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield


class TiledMLP(torch.autograd.Function):
    """``MLPRun``'s tiles as one autograd node: inputs (run, x, *params requiring grad)."""

    @staticmethod
    def forward(ctx: Any, run: MLPRun, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        ctx.save_for_backward(x)
        return run.forward_tiles(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        dx, dparams = ctx.run.backward_tiles(x, grad, ctx.needs_input_grad[1], tuple(ctx.needs_input_grad[2:]))
        return (None, dx, *dparams)
