"""Which saved tensors are worth moving off the device, and why the others stay.

The policy only classifies: it returns "" for "offload" or one short reason
string for "keep". Reasons are stable strings because the ledger, the
profilers and users' dashboards key on them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "REASONS",
    "TOO_SMALL",
    "PARAMETER",
    "BUFFER",
    "OTHER_DEVICE",
    "EXCLUDED_REGION",
    "DUPLICATE_STORAGE",
    "HOST_BUDGET",
    "UNSUPPORTED_TYPE",
    "DISABLED",
    "is_static_tensor",
    "classify",
    "storage_key",
    "storage_ptr",
    "storage_identity",
    "live_base",
    "StorageSet",
    "span_elems",
]

TOO_SMALL = "too_small"
"""Fewer bytes than ``min_offload_size`` (or empty): the copy would cost more than it frees."""
PARAMETER = "parameter"
"""A Parameter or a view of one (pack sees ``weight.t()``): it lives on the device anyway."""
BUFFER = "buffer"
"""A registered module buffer (or a view of one): it lives on the device anyway."""
OTHER_DEVICE = "other_device"
"""Not on the engine's device (e.g. a CPU tensor while offloading CUDA activations)."""
EXCLUDED_REGION = "excluded_region"
"""Saved inside an excluded module or region (the output head, ``ctx.excluded()``)."""
DUPLICATE_STORAGE = "duplicate_storage"
"""Same storage already offloaded this step: shares that host copy, nothing moved again."""
HOST_BUDGET = "host_budget"
"""The host budget (``host_budget_bytes`` / ``virtual_memory_safe_pct``) was full."""
UNSUPPORTED_TYPE = "unsupported_type"
"""A tensor subclass (NF4Tensor, DTensor, FakeTensor...) or a non-strided layout."""
DISABLED = "disabled"
"""The engine runs pass-through: no accelerator was found and no ``device`` given."""

REASONS: tuple[str, ...] = (
    TOO_SMALL,
    PARAMETER,
    BUFFER,
    OTHER_DEVICE,
    EXCLUDED_REGION,
    DUPLICATE_STORAGE,
    HOST_BUDGET,
    UNSUPPORTED_TYPE,
    DISABLED,
)


def is_static_tensor(t: torch.Tensor) -> bool:
    """True for a Parameter or a view of one (autograd saves ``weight.t()``, not the weight)."""
    if isinstance(t, nn.Parameter):
        return True
    base = getattr(t, "_base", None)
    return isinstance(base, nn.Parameter)


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of the tensor's storage: (device, data pointer)."""
    return (str(t.device), t.untyped_storage().data_ptr())


def span_elems(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) element range of the storage that ``t`` can touch (strides are >= 0)."""
    lo = t.storage_offset()
    if t.numel() == 0:
        return lo, lo
    hi = lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return lo, hi


def storage_ptr(t: torch.Tensor) -> int | None:
    """Data pointer of ``t``'s storage, of its local shard for DTensor, or None."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2 sharded parameters)
        return storage_ptr(local) if isinstance(local, torch.Tensor) else None


def _weak(t: torch.Tensor) -> Callable[[], torch.Tensor | None]:
    try:
        return weakref.ref(t)
    except TypeError:  # some subclasses refuse weakrefs: treat the storage as alive for the step
        return lambda: t


def live_base(ref: Callable[[], torch.Tensor | None] | None, key: tuple[Any, int]) -> torch.Tensor | None:
    """The weakly held base if it is alive and still on storage ``key``, else None.

    An address alone is not an identity: a freed source's address is reused
    mid-forward, so a storage key only matches while its first saver's base
    lives (and has not been re-pointed at another storage).
    """
    b = ref() if ref is not None else None
    if b is None:
        return None
    if key[0] != "id" and storage_ptr(b) != key[1]:
        return None
    return b


def storage_identity(t: torch.Tensor) -> tuple[tuple[Any, int], int]:
    """(key, bytes) of the storage behind ``t``.

    Tensors without a plain storage (subclasses), and empty storages (which
    all share address 0), are keyed by the tensor itself, so each such save
    counts once.
    """
    nbytes = t.numel() * t.element_size()
    try:
        st = t.untyped_storage()
        ptr, size = st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return ("id", id(t)), nbytes
    if ptr == 0:
        return ("id", id(t)), size
    return (str(t.device), ptr), size


class StorageSet:
    """The storages saved so far in one step, by live identity (shared by the
    engine's ledger and the profilers' trackers, so their unique bytes agree)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, int], Callable[[], torch.Tensor | None]] = {}

    def first_save(self, t: torch.Tensor) -> int:
        """Bytes of ``t``'s storage if this is its first save this step, else 0."""
        key, size = storage_identity(t)
        if live_base(self._seen.get(key), key) is not None:
            return 0
        base = t._base if t._base is not None else t
        self._seen[key] = _weak(base)
        return size

    def clear(self) -> None:
        self._seen.clear()


def _owned_storages(modules: Iterable[nn.Module]) -> tuple[set[int], set[int]]:
    params: set[int] = set()
    buffers: set[int] = set()
    for m in modules:
        for p in m._parameters.values():
            if p is not None:
                params.add(storage_ptr(p))
        for b in m._buffers.values():
            if b is not None:
                buffers.add(storage_ptr(b))
    return params, buffers


def classify(
    t: torch.Tensor,
    *,
    device: torch.device,
    min_offload_size: int,
    excluded: bool,
    static_ptrs: set[int],
    stack_modules: Iterable[nn.Module],
) -> str:
    """Return "" to offload ``t`` or the reason to keep it on its device.

    Order matters: what a tensor *is* (parameter, subclass, wrong device) wins
    over where it was saved (excluded region), which wins over how big it is.
    ``static_ptrs`` holds storages of a model given to the engine up front;
    ``stack_modules`` are the modules whose forward is running now, so buffers
    such as RoPE tables are caught without knowing the model in advance.
    """
    if is_static_tensor(t):
        return PARAMETER
    if type(t) is not torch.Tensor or t.layout != torch.strided:
        return UNSUPPORTED_TYPE
    if t.device != device:
        return OTHER_DEVICE
    if excluded:
        return EXCLUDED_REGION
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or nbytes < min_offload_size:
        return TOO_SMALL
    ptr = t.untyped_storage().data_ptr()
    if ptr in static_ptrs:
        return PARAMETER
    params, buffers = _owned_storages(stack_modules)
    if ptr in params:
        return PARAMETER
    if ptr in buffers:
        return BUFFER
    return ""
