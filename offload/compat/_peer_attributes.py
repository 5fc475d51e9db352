"""The peers' engine attributes that user code and the peers' own tests read.

torchtune's and TRL's ``OffloadActivations`` keep their state in public
attributes: ``tensor_id`` (how many tensors were packed), ``tracker`` (pack id
-> what happened to it), and in TRL ``storage_to_tensor_id`` (offloaded
storages), ``param_storages`` and ``update_model_params(model)``. Code written
against them (TRL's test suite; training loops that ``tracker.clear()`` after
an out-of-memory error) reads them from ours too.

NOTE [ Peer attributes are views ]
Our engine keeps none of that state: decisions live in the ledger, saved
tensors in the handles autograd holds (Rule 1 of NOTE [ Offload lifetime
rules ] in ``offload/engine.py``). So each attribute here is a fresh snapshot
built from the ledger when read. Consequences, all deliberate:

- Reading costs nothing on the hot path; the pack hook does no extra work.
- ``tracker``'s entries hold no tensors (the first field is None): a view that
  held them would keep every saved activation alive.
- Changing a snapshot (``tracker.clear()``) changes nothing in the engine,
  which needs no such reset: a step whose backward never ran is released with
  its graph, and the next forward starts clean.
- ``tracker`` and ``storage_to_tensor_id`` cover the open step (first pack to
  the end of its backward), as the peers' cover the packs not yet unpacked;
  after a backward both are empty. They are built from the ledger's record
  ring, so a step of more than ``max_records`` saves shows only its last ones.
"""

from __future__ import annotations

import re
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from ..ledger import OFFLOADED
from ..policy import model_storages, owned_storages

if TYPE_CHECKING:
    from ..engine import OffloadActivations

__all__ = ["PeerAttributes", "TrackedSave"]


class TrackedSave(NamedTuple):
    """One ``tracker`` entry, unpacking like TRL's 5-tuple: ``for _, modified, _, _, _ in tracker.values()``."""

    tensor: None
    """Always None: a view holds no tensor (NOTE [ Peer attributes are views ])."""
    modified: bool
    """True when the tensor was offloaded (the peers' meaning: its host copy will be brought back)."""
    stride: None
    """Always None (the ledger keeps no strides; unpack restores them: Rule 5)."""
    storage_offset: None
    """Always None."""
    shape: tuple[int, ...]
    """The saved tensor's shape."""


_COUNT = re.compile(r"count\((\d+)\)")


def _dtype(name: str) -> torch.dtype | str:
    """``"torch.float32"`` -> ``torch.float32`` (a record's dtype string; unknown names stay strings)."""
    dt = getattr(torch, name.rpartition(".")[2], None)
    return dt if isinstance(dt, torch.dtype) else name


class PeerAttributes:
    """torchtune's and TRL's engine attributes, as read-only views (NOTE [ Peer attributes are views ])."""

    def update_model_params(self: "OffloadActivations", model: nn.Module) -> None:
        """TRL's API: never offload ``model``'s parameters and buffers (the same as passing ``model=``).

        Takes effect at once, also inside an entered engine.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"OffloadActivations.update_model_params: model must be an nn.Module, got a "
                f"{type(model).__name__}. Pass the model being trained (its parameters and buffers "
                "then stay on the device)."
            )
        self._model_ref = weakref.ref(model)
        self._static_ptrs = model_storages(model)

    @property
    def param_storages(self: "OffloadActivations") -> set[int]:
        """TRL's attribute: storage data pointers of the model's parameters (local shards for DTensor).

        Empty until a model is known (``model=``, ``update_model_params``, or
        ``get_act_offloading_ctx_manager``). A snapshot: buffers are protected too,
        though TRL's set (and so this one) lists parameters only.
        """
        model = self._model_ref() if self._model_ref is not None else None
        if model is None:
            return set()
        return set(owned_storages(model.modules())[0])

    @property
    def tensor_id(self: "OffloadActivations") -> int:
        """The peers' counter: how many saved tensors this engine has packed (the last ``tracker`` key)."""
        m = _COUNT.fullmatch(repr(self._seq))
        if m is None:  # not CPython's itertools.count repr: count what the ledger saw
            return self.ledger.totals().packed_count
        return int(m.group(1))

    @property
    def tracker(self: "OffloadActivations") -> dict[int, TrackedSave]:
        """The peers' ``tracker``: pack id (1-based, as ``tensor_id`` counts) -> ``TrackedSave``, open step only.

        A snapshot (NOTE [ Peer attributes are views ]): ``modified`` is True for
        an offloaded tensor, False for one kept on the device (too small, a
        parameter, a duplicate of an offloaded storage, an excluded region...;
        ``ctx.ledger.records`` says which).
        """
        return {rec.seq + 1: TrackedSave(None, rec.decision == OFFLOADED, None, None, rec.shape)
                for rec in self._open_step_records()}

    @property
    def storage_to_tensor_id(self: "OffloadActivations") -> dict[tuple[int, Any], int]:
        """TRL's attribute: ``(storage pointer, dtype)`` -> first pack id offloaded from it, open step only."""
        out: dict[tuple[int, Any], int] = {}
        for rec in self._open_step_records():
            if rec.decision == OFFLOADED:
                out.setdefault((rec.storage_key, _dtype(rec.dtype)), rec.seq + 1)
        return out

    @property
    def min_tensor_size_bytes(self: "OffloadActivations") -> int:
        """The peers' name for ``min_offload_size`` (read-only: build a new engine to change it)."""
        return self.min_offload_size

    def _open_step_records(self: "OffloadActivations") -> list:
        ledger = self.ledger
        step = ledger.current_step
        return [rec for rec in ledger.records if rec.step == step]
