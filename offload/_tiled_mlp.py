"""The tiled MLP's autograd Function: a per-token module run over the sequence in tiles, recomputed in
backward one tile at a time (NOTE [ Tiles ] in offload/tiling.py).

Forward runs the tiles without autograd and writes each tile's results into results shaped as the untiled
call's (``offload/_token_call.py``); only the call's tensors are saved. Backward recomputes each tile with
autograd on (the forward's RNG and autocast state restored, the same tiles) on detached aliases of the
parameters, takes the tile's input and alias gradients with
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
from torch.utils._pytree import tree_leaves

from .errors import OffloadError
from ._token_call import TileOutputs, TokenCall, token_dim
from .policy import storage_ptr

__all__ = ["MLPRun", "TiledMLP", "tile_slices", "AutocastState", "RngState"]


def tile_slices(n: int, rows: int, start: int = 0) -> Iterator[slice]:
    """``slice``s of ``rows`` items covering ``range(start, n)`` in order (the last one may be shorter)."""
    for i in range(start, n, rows):
        yield slice(i, min(n, i + rows))


def _two_sizes(n: int, rows: int) -> list[slice]:
    """The tiles after a first of ``rows`` items, covering ``range(rows, n)`` so that some tile has another
    size than ``rows`` (``TileOutputs.checked``): a last tile of ``rows`` is split in ``rows - 1`` and 1."""
    rest = list(tile_slices(n, rows, rows))
    if rows > 1 and rest and rest[-1].stop - rest[-1].start == rows:
        last = rest.pop()
        rest += [slice(last.start, last.stop - 1), slice(last.stop - 1, last.stop)]
    return rest


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

    def __init__(self, fn: Callable[..., Any], module: nn.Module, call: TokenCall, rows: int,
                 params: list[nn.Parameter], record: Callable[[int, int], None] | None) -> None:
        self.fn = fn
        self.module = module
        self.call = call
        self.rows = rows
        self.params = params
        """The module's parameters that require grad, in the order they were passed to ``TiledMLP``."""
        self.record = record
        self.rng: RngState | None = None
        self.autocast: AutocastState | None = None
        self.outputs: TileOutputs | None = None
        self.slices: list[slice] = []
        """The tiles, as the forward ran them (backward replays them)."""
        self.mutated: list[str] = []
        """The module's buffers its forward tiles wrote or replaced (a counter of tokens per expert):
        backward's recompute leaves them as the forward did (``_buffers_kept``)."""

    def _tile(self, parts: list[torch.Tensor]) -> Any:
        x, args, kwargs = self.call.tile(parts)
        return self.fn(x, *args, **kwargs)

    def _check_owned(self, roots: list[torch.Tensor], owned: list[torch.Tensor]) -> None:
        """Refuse a module that computes with a tensor needing a gradient that it does not own (a parameter
        of another module, kept as a plain attribute): its gradient would be lost (``_outside_leaves``)."""
        outside = _outside_leaves(roots, owned)
        if outside:
            shapes = ", ".join(str(tuple(t.shape)) for t in outside[:3])
            raise OffloadError(
                f"offload.tiling.tile_mlp: {type(self.module).__name__} computes with {len(outside)} tensor(s) "
                f"needing a gradient that are neither its parameters nor its input (shapes {shapes}: another "
                "module's parameter kept as a plain attribute, a tensor from outside); the tiles differentiate the "
                "module's own parameters and its input, so those would get no gradient. Register them on the "
                "module, or leave it untiled (tiled_mlp=False).")

    def check_per_token(self) -> None:
        """Refuse a module whose result for a token depends on the tokens beside it (RWKV's feed-forward
        shifts the tokens by one; a convolution along the sequence): the tiles would cut that at every tile's
        edge, silently. Token 1 is computed with token 0 (tokens 0-1) and with token 2 (tokens 1-2): its
        results must agree. Without autograd, in eval mode (no dropout draws), the RNG and the buffers left as
        they were; once per module, before its first tiled forward (``TilingHandle._check_per_token``)."""
        call = self.call
        flat = [call.flat(t) for t in call.tensors]
        names = [n for n, _ in self.module.named_buffers()]
        with torch.no_grad(), _eval(self.module), RngState(call.tensors[0].device).restored(), \
                _buffers_kept(self.module, names):
            before, after = (self._tile([f[:, sl] for f in flat]) for sl in (slice(0, 2), slice(1, 3)))
        for a, b in zip(_tensors(before), _tensors(after)):
            got = _token_1(a, b)
            if got is not None and not _agree(*got):
                raise OffloadError(
                    f"offload.tiling.tile_mlp: {type(self.module).__name__}'s result for a token depends on the "
                    "tokens beside it (token 1 computed with token 0 and with token 2 gave other results; RWKV's "
                    "feed-forward shifts the tokens, a convolution along the sequence mixes them): the tiles would "
                    "cut that at every tile's edge. Pass modules=[...] naming only per-token modules, or "
                    "tiled_mlp=False in offload.long_context.")

    def forward_tiles(self) -> Any:
        """The module over the call's tokens, tile by tile, without autograd: the glued results (the call's
        tensors are dropped after: ``TokenCall.release``)."""
        call = self.call
        self.rng, self.autocast = RngState(call.tensors[0].device), AutocastState(call.tensors[0].device.type)
        flat = [call.flat(t) for t in call.tensors]
        before = {n: (b, b._version) for n, b in self.module.named_buffers()}
        with torch.no_grad():
            first = slice(0, self.rows)
            y = self._tile([f[:, first] for f in flat])
            self.outputs = out = TileOutputs(type(self.module).__name__, call, y, self.rows)
            rest = list(tile_slices(call.n, self.rows, self.rows)) if out.checked else _two_sizes(call.n, self.rows)
            self.slices = [first, *rest]
            out.add(y, first)
            del y
            for sl in rest:
                out.add(self._tile([f[:, sl] for f in flat]), sl)
        after = dict(self.module.named_buffers())
        self.mutated = [n for n, (b, v) in before.items() if after.get(n) is not b or b._version != v]
        call.release()
        return self.outputs.result()

    def backward_tiles(self, inputs: list[torch.Tensor], grads: tuple[torch.Tensor | None, ...],
                       need_in: tuple[bool, ...], need: tuple[bool, ...]
                       ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Recompute each tile and return ([d input] in ``call.tensors`` order, [d param] in ``params`` order,
        float32-summed)."""
        call, outs = self.call, self.outputs
        flat = [call.flat(t) for t in inputs]
        wanted = [p for p, n in zip(self.params, need) if n]
        d_in = [torch.empty_like(f) if n else None for f, n in zip(flat, need_in)]
        acc: list[torch.Tensor | None] = [None] * len(wanted)
        counter = _SavedBytes(self.module, flat)
        incoming = {storage_ptr(g) for g in grads if g is not None}
        with self.rng.restored(), self.autocast.restored(), torch.enable_grad(), \
                _aliased(self.module, wanted) as leaves, _buffers_kept(self.module, self.mutated):
            counter.params += leaves
            for sl in self.slices:
                parts = [f[:, sl].detach().requires_grad_(n) for f, n in zip(flat, need_in)]
                with counter.counting():
                    yi = outs.parts(self._tile(parts))
                pairs = [(y, outs.tile_of(i, g, sl)) for i, (y, g) in enumerate(zip(yi, grads))
                         if g is not None and y is not None and y.requires_grad]
                if sl.start == 0:
                    self._check_owned([y for y, _ in pairs], [*parts, *leaves, *self.module.parameters()])
                wrt = [p for p, n in zip(parts, need_in) if n] + leaves
                got = torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs],
                                          allow_unused=True) if pairs else (None,) * len(wrt)
                got = list(got)
                for d in d_in:
                    if d is not None:
                        g = got.pop(0)
                        d[:, sl] = g if g is not None else 0
                _accumulate(acc, got, incoming)
        if self.record is not None:
            self.record(counter.nbytes, len(self.slices))
        out = iter(None if a is None else a.to(p.dtype) for a, p in zip(acc, wanted))
        return ([None if d is None else d.view_as(t) for d, t in zip(d_in, inputs)],
                [next(out) if n else None for n in need])


def _tensors(y: Any) -> list[torch.Tensor]:
    return [v for v in tree_leaves(y) if isinstance(v, torch.Tensor)]


def _token_1(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Token 1's result in ``a`` (tokens 0-1) and in ``b`` (tokens 1-2), by the layouts a tile's result may
    have (``token_dim``), or None where ``a`` has neither (the tiles refuse it themselves)."""
    d = token_dim(a, 2) if a.shape == b.shape else None
    if d is None:
        return None
    lead = (slice(None),) * d
    return a[lead + (1,)], b[lead + (0,)]


def _agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, or for floats within 5 % of the result's largest magnitude: per-token math agrees within a
    rounding of the dtype (bf16's is 0.4 %); a token shift changes the result by a mixing coefficient."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    a, b = a.float(), b.float()
    return float((a - b).abs().max()) <= 0.05 * max(float(a.abs().max()), float(b.abs().max()), 1e-30)


@contextlib.contextmanager
def _eval(module: nn.Module) -> Iterator[None]:
    """``module`` and its submodules in eval mode while inside, each put back as it was."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _outside_leaves(roots: list[torch.Tensor], owned: list[torch.Tensor], limit: int = 100_000) -> list[torch.Tensor]:
    """Tensors with a gradient of their own that the graph of ``roots`` (a tile's results) reaches besides
    ``owned`` (the tile's inputs and the module's parameter aliases): the tiles take gradients for ``owned``
    alone, so these would get none. Walks at most ``limit`` nodes (a tile's graph has tens)."""
    ids = {id(t) for t in owned}
    seen, todo, outside = set(), [y.grad_fn for y in roots], []
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


def _accumulate(acc: list[torch.Tensor | None], grads: list[torch.Tensor | None], incoming: set[int]) -> None:
    """Add each tile's parameter gradient into its float32 sum (the first float32 one is summed into in
    place, unless it is an incoming gradient itself (``incoming``: their storages), which autograd may pass
    through for a parameter shaped like an output)."""
    for i, g in enumerate(grads):
        if g is None:
            continue
        if acc[i] is None:
            shared = storage_ptr(g) in incoming
            acc[i] = g.float() if g.dtype != torch.float32 else (g.clone() if shared else g)
        else:
            acc[i].add_(g)


class _SavedBytes:
    """Counts the bytes a tile's recompute saves for backward that are activations (not the tile's inputs,
    a parameter, or a view or cast of one): what the untiled module saves from forward to backward."""

    def __init__(self, module: nn.Module, inputs: list[torch.Tensor]) -> None:
        self.params = list(module.parameters())
        self.ptrs = {storage_ptr(p) for p in self.params} | {storage_ptr(x) for x in inputs}
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
    """``MLPRun``'s tiles as one autograd node: inputs (run, *the call's tensors, *params requiring grad);
    outputs the call's results (one tensor, or a tuple of tensors and Nones)."""

    @staticmethod
    def forward(ctx: Any, run: MLPRun, *inputs: torch.Tensor) -> Any:
        ctx.run = run
        ctx.k = len(run.call.tensors)
        ctx.set_materialize_grads(False)  # (a result nobody uses gets no gradient, not zeros)
        ctx.save_for_backward(*inputs[:ctx.k])
        out = run.forward_tiles()
        items = [out] if isinstance(out, torch.Tensor) else list(out)
        ctx.mark_non_differentiable(*(t for t in items if t is not None and not t.is_floating_point()))
        return out if isinstance(out, torch.Tensor) else tuple(items)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        k, need = ctx.k, tuple(ctx.needs_input_grad[1:])
        d_in, d_params = ctx.run.backward_tiles(list(ctx.saved_tensors), grads, need[:k], need[k:])
        return (None, *d_in, *d_params)
