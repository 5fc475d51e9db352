"""One call of a per-token module cut along its tokens: the arguments split into tiles, the results glued
back (NOTE [ Tiles ] in offload/tiling.py).

The first argument (``x``, ``(..., hidden)``) gives the tokens: ``x.shape[:-1]``. Every other tensor
argument must begin with those dimensions (Bloom's MLP takes the residual; DeepSeek-V4's mixture of experts
the token ids) and is cut with it; anything else (None, a number, a flag) goes to every tile as it is. Each
tile sees its tokens as ``(1, t, ...)``. A result is one tensor or a tuple (or list) of tensors and Nones;
each tensor has the tile's tokens first, either as the tile was given them (``(1, t, ...)``) or flattened
(``(t, ...)``: GPT-OSS's router scores, transformers 4.x's mixtures of experts' router logits). Glued, the
first kind is ``(*x.shape[:-1], ...)`` and the second ``(tokens, ...)``, as the untiled call returns them.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import OffloadError

__all__ = ["TokenCall", "TileOutputs", "token_dim"]

_ANY_TILE = "a tiled module must map each token on its own"


def token_dim(v: torch.Tensor, rows: int) -> int | None:
    """Where a tile's result ``v`` has the tile's ``rows`` tokens: 1 (as given, after a batch of 1), 0
    (flattened first), or None (neither: not a per-token result)."""
    if v.dim() >= 2 and v.shape[0] == 1 and v.shape[1] == rows:
        return 1
    return 0 if v.dim() >= 1 and v.shape[0] == rows else None


class TokenCall:
    """A call's arguments: ``tensors`` (``x`` first, then each tensor argument, as passed) are cut along the
    tokens (``flat``, then sliced); ``tile(parts)`` builds one tile's ``(x, args, kwargs)`` from their pieces."""

    def __init__(self, owner: str, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        lead = tuple(x.shape[:-1])
        self.n = x.shape[:-1].numel()
        """Tokens in the call."""
        self.lead = lead
        self.args, self.kwargs = list(args), dict(kwargs)
        self.slots: list[int | str] = []
        """Where each tensor after ``x`` goes: a position in ``args`` or a key of ``kwargs``."""
        self.tensors: list[torch.Tensor] = [x]
        for slot, v in [*enumerate(args), *kwargs.items()]:
            if not isinstance(v, torch.Tensor):
                continue
            if tuple(v.shape[:len(lead)]) != lead:
                where = f"argument {slot + 2}" if isinstance(slot, int) else f"{slot}="
                raise OffloadError(
                    f"offload.tiling.tile_mlp: {owner} was called with a tensor of shape {tuple(v.shape)} as its "
                    f"{where}, which does not begin with the tokens of its input (shape {tuple(x.shape)}: "
                    f"{lead}); {_ANY_TILE}, and every tensor it takes must have the tokens first. Pass "
                    "modules=[...] naming only per-token modules, or tiled_mlp=False in offload.long_context.")
            self.slots.append(slot)
            self.tensors.append(v)

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with its token dimensions as one, after a batch dimension of 1: ``(1, tokens, ...)``."""
        return t.reshape(1, self.n, *t.shape[len(self.lead):])

    def release(self) -> None:
        """Drop the call's tensors (forward is done): what backward needs of them autograd saved, through the
        saved-tensor hooks (an engine may offload them); a reference here would keep them on the device."""
        for slot in self.slots:
            if isinstance(slot, int):
                self.args[slot] = None
            else:
                self.kwargs[slot] = None
        self.tensors = []

    def tile(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[Any], dict[str, Any]]:
        """One tile's ``(x, args, kwargs)`` from its piece of each of ``tensors`` (``parts``, in that order)."""
        args, kwargs = list(self.args), dict(self.kwargs)
        for slot, t in zip(self.slots, parts[1:]):
            if isinstance(slot, int):
                args[slot] = t
            else:
                kwargs[slot] = t
        return parts[0], args, kwargs


class TileOutputs:
    """The tiles' results glued along the tokens into results shaped as the untiled call's. Built from the
    first tile's result; ``add`` writes each tile's (checked against the first's structure); ``result()``
    is what the call returns; ``items``, the tensors (or Nones) in order."""

    def __init__(self, owner: str, call: TokenCall, y: Any, rows: int) -> None:
        self.owner, self.call = owner, call
        self.single = isinstance(y, torch.Tensor)
        got = (y,) if self.single else y
        if not isinstance(got, (tuple, list)):
            self._refuse(type(y).__name__, rows)
        self.kind = type(got)
        self.dims: list[int | None] = [self._dim(v, rows) for v in got]
        """Per result: None (a None), 1 (the tokens after a batch of 1), 0 (the tokens flattened first)."""
        self.items: list[torch.Tensor | None] = []
        self._views: list[torch.Tensor | None] = []  # each result as (1, tokens, ...) or (tokens, ...)
        for v, d in zip(got, self.dims):
            if d is None:
                self.items.append(None)
                self._views.append(None)
                continue
            rest = tuple(v.shape[d + 1:])
            full = v.new_empty((*call.lead, *rest) if d else (call.n, *rest))
            self.items.append(full)  # (a tensor of its own, not a view: the model may add into it in place)
            self._views.append(full.view(1, call.n, *rest) if d else full)

    def _dim(self, v: Any, rows: int) -> int | None:
        if v is None:
            return None
        d = token_dim(v, rows) if isinstance(v, torch.Tensor) else None
        if d is None:
            self._refuse(type(v).__name__ if not isinstance(v, torch.Tensor) else
                         f"a tensor of shape {tuple(v.shape)}", rows)
        return d

    def _refuse(self, got: str, rows: int) -> None:
        raise OffloadError(
            f"offload.tiling.tile_mlp: {self.owner} returned {got} for an input of shape (1, {rows}, hidden); "
            f"{_ANY_TILE} and return tensors (or a tuple of them) with the tokens first, as it took them or "
            "flattened. Pass modules=[...] naming only per-token modules, or tiled_mlp=False in "
            "offload.long_context.")

    def parts(self, y: Any) -> list[torch.Tensor | None]:
        """A tile's result as a list in ``items`` order, checked against the first tile's structure."""
        got = [y] if self.single else y
        if (self.single != isinstance(y, torch.Tensor) or not isinstance(got, (tuple, list))
                or len(got) != len(self.dims)):
            raise OffloadError(f"offload.tiling.tile_mlp: {self.owner} returned a result of another structure "
                               f"for a later tile ({type(y).__name__}); {_ANY_TILE}.")
        return list(got)

    def add(self, y: Any, sl: slice) -> None:
        """Write one tile's result (tokens ``sl``) into the glued results, each tensor checked to have that
        tile's tokens where the first tile's had them."""
        t = sl.stop - sl.start
        for v, d, view in zip(self.parts(y), self.dims, self._views):
            if (v is None) != (d is None):
                raise OffloadError(f"offload.tiling.tile_mlp: {self.owner} returned None for some tiles and a "
                                   f"tensor for others; {_ANY_TILE}.")
            if view is None:
                continue
            want = (1, t, *view.shape[2:]) if d else (t, *view.shape[1:])
            if tuple(v.shape) != want or v.dtype != view.dtype:
                raise OffloadError(
                    f"offload.tiling.tile_mlp: {self.owner} returned a tensor of shape {tuple(v.shape)} "
                    f"({v.dtype}) for a tile of {t} tokens, where the tokens of the tile's input should be "
                    f"{want} ({view.dtype}, from the first tile); {_ANY_TILE}. Pass modules=[...] naming only "
                    "per-token modules, or tiled_mlp=False in offload.long_context.")
            view[(slice(None),) * d + (sl,)] = v

    @property
    def checked(self) -> bool:
        """Whether tiles of one size suffice: one tensor result, the tokens after a batch of 1 (an MLP's).
        Otherwise the tiles must come in two sizes, so that each result is seen to follow the tokens."""
        return self.single and self.dims == [1]

    def tile_of(self, i: int, t: torch.Tensor, sl: slice) -> torch.Tensor:
        """Tokens ``sl`` of ``t``, a tensor shaped as result ``i`` (its incoming gradient)."""
        d = self.dims[i]
        v = t.reshape(1, self.call.n, *t.shape[len(self.call.lead):]) if d else t
        return v[(slice(None),) * d + (sl,)]

    def result(self) -> Any:
        """The glued results, as the untiled call returns them; forgets them (backward needs only their
        structure, and a reference here would keep them alive as long as the graph)."""
        items, self.items, self._views = self.items, [None] * len(self.items), [None] * len(self.items)
        return items[0] if self.single else self.kind(items)
