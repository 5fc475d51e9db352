"""Which saved tensors are worth moving off the device, and why the others stay.

The policy only classifies: it returns "" for "offload" or one short reason
string for "keep". Reasons are stable strings because the ledger, the
profilers and users' dashboards key on them. The host-RAM ceiling that turns
an offload into a ``host_budget`` keep is here too (``RamCeiling``).

Everything here runs inside the pack hook, once per saved tensor, on the
thread that launches kernels: cheap checks first, no system call per tensor.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import psutil
import torch
from torch import nn

from ._fake import FAKE_TENSOR as _FAKE_TENSOR
from ._fake import fake_storage_id
from ._torch_private import graph_task_id_c as _graph_task_id

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
    "IN_BACKWARD",
    "AFTER_HEAD",
    "is_static_tensor",
    "is_unsupported",
    "classify",
    "storage_key",
    "storage_ptr",
    "storage_identity",
    "live_base",
    "StorageSet",
    "span_elems",
    "owned_storages",
    "shape_of",
    "device_name",
    "dtype_name",
    "RamCeiling",
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
"""Cannot be rebuilt from its bytes, so never moved: a tensor subclass (NF4Tensor,
DTensor, FakeTensor...), a non-strided layout (sparse, mkldnn, jagged), a strided
nested tensor, a quantized tensor (its quantizer is not in the bytes), an
efficient zero tensor (``torch.func.jvp``) or any tensor without a storage."""
DISABLED = "disabled"
"""The engine runs pass-through: no accelerator was found and no ``device`` given."""

IN_BACKWARD = "in_backward"
"""Saved while a backward pass runs (a forward recomputed by reentrant checkpointing inside a
context that wraps the whole step, double backward): consumed at once, so moving it buys nothing."""
AFTER_HEAD = "after_head"
"""Saved after the output head's forward in the same model call (the loss and its log-probs):
backward needs it first, so no prefetch could hide its reload."""

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
    IN_BACKWARD,
    AFTER_HEAD,
)
"""Why a saved tensor was kept on the device: every ``reason`` a kept ``PackRecord`` can carry, in order."""


_Tensor = torch.Tensor
_Parameter = nn.Parameter
_STRIDED = torch.strided
REASON_BY_TYPE: dict[type, str] = {_Parameter: PARAMETER}
"""The reason to keep a saved tensor of exactly this type, whatever else is true of it (``classify``'s
first rule: a Parameter stays where it is); what the pack hook looks up before anything else."""


def _is_param(x: torch.Tensor) -> bool:
    # isinstance(x, Parameter) goes through _ParameterMeta.__instancecheck__ (a
    # Python call, ~0.5 us); these exact-type tests give the same answer for
    # the common types at a tenth of the cost (pack runs once per saved tensor).
    cls = type(x)
    if cls is _Tensor:
        return bool(getattr(x, "_is_param", False))  # what the metaclass checks for plain tensors
    return cls is _Parameter or isinstance(x, _Parameter)


def is_static_tensor(t: torch.Tensor) -> bool:
    """True for a Parameter or a view of one (autograd saves ``weight.t()``, not the weight)."""
    if _is_param(t):
        return True
    base = getattr(t, "_base", None)
    return base is not None and _is_param(base)


def is_unsupported(t: torch.Tensor) -> bool:
    """True when ``t``'s bytes alone cannot rebuild it, so it must stay where it is.

    Subclasses (NF4Tensor, DTensor, FakeTensor, functorch and functional
    wrappers), non-strided layouts (sparse, mkldnn, jagged nested), strided
    nested tensors (no single shape), quantized tensors (the quantizer is not
    in the bytes) and efficient zero tensors (no storage at all: what
    ``torch.func.jvp`` and forward-over-reverse products save).
    """
    return (type(t) is not _Tensor or t.layout != _STRIDED or t.is_nested or t.is_quantized
            or t._is_zerotensor())


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of the tensor's storage: (device, data pointer; a fake tensor's: its storage id)."""
    return (device_name(t.device), storage_ptr(t) or 0)


def span_elems(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) element range of the storage that ``t`` can touch (strides are >= 0)."""
    lo = t.storage_offset()
    if t.is_contiguous():
        return lo, lo + t.numel()
    if t.numel() == 0:
        return lo, lo
    hi = lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return lo, hi


def storage_ptr(t: torch.Tensor) -> int | None:
    """Data pointer of ``t``'s storage, of its local shard for DTensor, or None. A fake tensor's
    storage has no address: its unique id stands in (``offload._fake``)."""
    try:
        if type(t) is _FAKE_TENSOR:
            return fake_storage_id(t.untyped_storage())
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


_DEVICE_NAMES: dict[torch.device, str] = {}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def device_name(device: torch.device) -> str:
    """``str(device)``, cached (``str`` of a torch.device costs ~0.6 us; pack needs it per tensor)."""
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


def dtype_name(dtype: torch.dtype) -> str:
    """``str(dtype)``, cached, e.g. "torch.bfloat16"."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """``tuple(t.shape)``, or () where there is no single shape (strided nested tensors)."""
    try:
        return tuple(t.shape)
    except (RuntimeError, NotImplementedError, TypeError):
        return ()


def storage_identity(t: torch.Tensor) -> tuple[tuple[Any, int], int]:
    """(key, bytes) of the storage behind ``t``.

    Tensors without a plain storage (subclasses), and empty storages (which
    all share address 0), are keyed by the tensor itself, so each such save
    counts once.
    """
    nbytes = t.numel() * t.element_size()
    try:
        st = t.untyped_storage()
        ptr, size = (st.data_ptr() if type(t) is not _FAKE_TENSOR else fake_storage_id(st)), st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return ("id", id(t)), nbytes
    if ptr == 0:
        return ("id", id(t)), size
    return (device_name(t.device), ptr), size


class StorageSet:
    """The storages saved so far in one step, by live identity (shared by the
    engine's ledger and the profilers' trackers, so their unique bytes agree)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, int], Callable[[], torch.Tensor | None]] = {}

    def first_save(self, t: torch.Tensor) -> int:
        """Bytes of ``t``'s storage if this is its first save this step, else 0."""
        key, size = storage_identity(t)
        return self.first_save_of(t, key, size)

    def first_save_of(self, t: torch.Tensor, key: tuple[Any, int], size: int) -> int:
        """``first_save`` for a caller that already has ``storage_identity(t)``."""
        ref = self._seen.get(key)
        base = t._base
        if ref is not None:
            b = ref()
            # Same object as this save's base: on this storage by construction.
            if b is not None and (b is t or b is base or live_base(ref, key) is not None):
                return 0
        self._seen[key] = _weak(t if base is None else base)
        return size

    def clear(self) -> None:
        self._seen.clear()


_UNREAD = object()


def owned_storages(modules: Iterable[nn.Module]) -> tuple[frozenset[int], frozenset[int]]:
    """Storage pointers of the direct parameters, and of the direct buffers (not also a
    parameter's), of ``modules``: what ``classify`` keeps as PARAMETER / BUFFER by storage."""
    params: set[int] = set()
    bufs: set[int] = set()
    for m in modules:
        for p in m._parameters.values():
            if p is not None and (q := storage_ptr(p)):
                params.add(q)
        for b in m._buffers.values():
            if b is not None and (q := storage_ptr(b)):
                bufs.add(q)
    return frozenset(params), frozenset(bufs - params)


def model_storages(model: nn.Module) -> dict[int, str]:
    """Storage pointer -> PARAMETER / BUFFER for every parameter and buffer of ``model``.

    What the engine keeps by storage when it knows the model up front (a storage
    that holds both is a parameter's); the reason names which it was.
    """
    params, bufs = owned_storages(model.modules())
    return {**dict.fromkeys(bufs, BUFFER), **dict.fromkeys(params, PARAMETER)}


def _owns_storage(modules: Iterable[nn.Module], ptr: int) -> str:
    """PARAMETER / BUFFER when a direct parameter / buffer of one of ``modules`` lives on ``ptr``, else ""."""
    params, bufs = owned_storages(modules)
    return PARAMETER if ptr in params else BUFFER if ptr in bufs else ""


def classify(
    t: torch.Tensor,
    *,
    device: torch.device,
    min_offload_size: int,
    excluded: bool,
    static_ptrs: "dict[int, str] | set[int]",
    stack_modules: Iterable[nn.Module] | Callable[[], Iterable[nn.Module]],
    nbytes: int | None = None,
    ptr: int | None | object = _UNREAD,
    after_head: bool = False,
) -> str:
    """Return "" to offload ``t`` or the reason to keep it on its device.

    The one statement of the rules for a saved tensor (the engine's pack hook
    calls it; ``offload/_native/pack.cpp`` restates it in C++ for plain tensors and
    ``tests/offload/test_native.py`` keeps the two equal). Order matters: what a
    tensor *is* (parameter, unsupported type, wrong device) wins over where it
    was saved (excluded region), which wins over how big it is; a tensor the
    policy would move or found too small stays when it was saved during a
    backward pass (``in_backward``, Rule 11) or after the output head
    (``after_head``, Rule 8). ``static_ptrs`` holds storages of a model given to
    the engine up front (``model_storages``: storage -> PARAMETER / BUFFER; a set
    means PARAMETER for each); ``stack_modules`` are the modules whose forward is
    running now (or a function returning them, called only for a leaf that
    would otherwise be offloaded), so buffers such as RoPE tables are caught
    without knowing the model in advance. ``nbytes`` (numel x element size) and
    ``ptr`` (``storage_ptr(t)``; None for a tensor without a storage) save
    reading them again when the caller has them.

    Runs once per saved tensor on the kernel-launching thread, so the cheap
    tests come first and the storage walks only for offload candidates.
    """

    def owner(p: int) -> str:
        return _owns_storage(stack_modules() if callable(stack_modules) else stack_modules, p)

    return _classify(t, device, min_offload_size, excluded, static_ptrs, owner, nbytes, ptr, after_head)


def _classify(t: torch.Tensor, device: torch.device, min_offload_size: int, excluded: bool,
              static_ptrs: "dict[int, str] | set[int]", owner: Callable[[int], str], nbytes: int | None,
              ptr: Any, after_head: bool, base: Any = _UNREAD, on_device: bool | None = None,
              leaf: Any = _UNREAD) -> str:
    """``classify`` with positional arguments (a keyword call costs the pack hook ~0.2 us) and
    ``owner(ptr)``: PARAMETER / BUFFER when a running module's parameter / buffer lives on ``ptr``.

    Facts the caller has read come as arguments (the pack hook reads each once): ``base``, ``on_device``
    (``t.device == device``), ``leaf``. ``on_device`` only from a caller that found ``t`` plain (exactly
    ``torch.Tensor`` or ``nn.Parameter``; storage at ``ptr``, strided, not nested or quantized), as ``_pack``
    does; None: all of that is checked here.
    """
    # is_static_tensor and is_unsupported, inlined for the plain-tensor case.
    if leaf is _UNREAD:
        leaf = t.is_leaf
    if type(t) is _Tensor:
        if leaf and getattr(t, "_is_param", False):
            # nn.Parameter's flag for a tensor it cannot subclass; a tensor with autograd
            # history is never a parameter itself (a view of one is caught through _base).
            return PARAMETER
        if base is _UNREAD:
            base = t._base
        if base is not None and _is_param(base):
            return PARAMETER
        if on_device is None:
            if ptr is _UNREAD:
                ptr = storage_ptr(t)
            # No storage: efficient zero tensors, functional / functorch wrappers.
            if ptr is None or t.layout != _STRIDED or t.is_nested or t.is_quantized:
                return UNSUPPORTED_TYPE
    elif type(t) in REASON_BY_TYPE:
        return REASON_BY_TYPE[type(t)]
    elif is_static_tensor(t):
        return PARAMETER
    elif type(t) is not _FAKE_TENSOR:
        return UNSUPPORTED_TYPE  # a subclass
    elif on_device is None and ((ptr := storage_ptr(t) if ptr is _UNREAD else ptr) is None or t.layout != _STRIDED):
        return UNSUPPORTED_TYPE  # (offload.predict's fake tensors follow the rules of what they stand for)
    if not (t.device == device if on_device is None else on_device):
        return OTHER_DEVICE
    if excluded:
        return EXCLUDED_REGION
    if nbytes is None:
        nbytes = t.numel() * t.element_size()
    if nbytes == 0 or nbytes < min_offload_size:
        reason = TOO_SMALL
    elif ptr in static_ptrs:
        return static_ptrs[ptr] if type(static_ptrs) is dict else PARAMETER
    else:
        # Autograd history: computed in this forward, so not a parameter or buffer (a
        # parameter's view was caught through its _base above). Only leaves can be.
        reason = (leaf and owner(ptr)) or ""
        if reason:
            return reason
    # Where it was saved decides for a tensor the policy would move or found too small.
    if _graph_task_id() >= 0:
        return IN_BACKWARD  # Rule 11
    if after_head:
        return AFTER_HEAD  # Rule 8
    return reason


class RamCeiling:
    """System RAM ceiling (``virtual_memory_safe_pct``) without a system call per tensor.

    ``psutil.virtual_memory()`` reads /proc (tens of microseconds), too slow
    for a hook that runs for every saved tensor. The gauge samples it at most
    every ``max_age_s`` seconds, or once ``slack_bytes`` have been granted
    since the last sample, and in between adds every byte it grants to the
    sampled use, as if each were newly allocated (pool reuse makes that an
    over-estimate, never an under-estimate).

    Bound: the engine's own allocations can never take system RAM above the
    ceiling; memory that *other* allocators (the rest of the process, other
    processes) take is seen at most ``max_age_s`` late. A refusal based on an
    estimate that includes granted bytes is re-checked against a fresh sample
    (at most every ``max_age_s / 10``), so pool reuse does not cause lasting
    false refusals.
    """

    __slots__ = ("max_age_s", "slack_bytes", "samples", "pct", "_used", "_total", "_granted", "_t")

    def __init__(self, max_age_s: float = 0.05, slack_bytes: int = 256 << 20, pct: float = 100.0) -> None:
        self.pct = pct
        """The ceiling ``__call__`` applies (percent of system RAM)."""
        self.max_age_s = max_age_s
        """Oldest sample the gauge trusts, in seconds."""
        self.slack_bytes = slack_bytes
        """Bytes granted since the last sample that force a new one."""
        self.samples = 0
        """How many times system RAM was actually read."""
        self._used = 0
        self._total = 0
        self._granted = 0
        self._t = -float("inf")

    def _sample(self, now: float) -> None:
        vm = psutil.virtual_memory()
        self._used, self._total = vm.total - vm.available, vm.total
        self._granted = 0
        self._t = now
        self.samples += 1

    def allows(self, nbytes: int, pct: float) -> bool:
        """Whether ``nbytes`` more keeps system RAM use at or below ``pct`` percent (and grant them)."""
        now = time.monotonic()
        if now - self._t > self.max_age_s or self._granted + nbytes > self.slack_bytes:
            self._sample(now)
        if (self._used + self._granted + nbytes) * 100.0 > pct * self._total:
            if self._granted == 0 or now - self._t < self.max_age_s / 10:
                return False
            self._sample(now)  # the estimate counted reused buffers as new: look again
            if (self._used + nbytes) * 100.0 > pct * self._total:
                return False
        self._granted += nbytes
        return True

    def __call__(self, nbytes: int) -> bool:
        """``allows(nbytes, self.pct)``: the gauge as a ``HostPool.grow_gate``."""
        return self.allows(nbytes, self.pct)
