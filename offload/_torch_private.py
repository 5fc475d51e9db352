"""Every use of a private PyTorch API in the engine lives here, each with its reason.

Keeping them in one small module means a PyTorch upgrade that moves one of them
breaks one file, and the rest of the engine reads as public-API code.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable

import torch

from ._fake import FAKE_TENSOR as _FAKE_TENSOR

logger = logging.getLogger("offload.pinned")

__all__ = [
    "neg_view",
    "graph_task_id",
    "queue_end_of_backward",
    "register_host_memory",
    "unregister_host_memory",
    "clear_last_cuda_error",
    "empty_host_cache",
    "version_tracker",
    "profiler_enabled",
    "top_saved_tensors_hooks",
    "remove_saved_tensors_hooks",
    "sanitizer_core",
    "cuda_allocated_and_peak",
    "extension_build_dir",
    "function_modes",
]


def graph_task_id() -> int:
    """Id of the autograd graph task running on this thread, -1 outside backward.

    Why private: there is no public way to tell that a new backward pass began,
    and the engine closes a ledger step and drains its stash once per pass.
    """
    return torch._C._current_graph_task_id()


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass finishes (must be called during it).

    Why private: ``Variable._execution_engine.queue_callback`` is the only hook
    into the end of a graph task; torch.utils.checkpoint uses it the same way.
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def register_host_memory(t: torch.Tensor) -> bool:
    """Page-lock an existing CPU tensor's memory in place (CUDA only).

    Why private: ``torch.empty(..., pin_memory=True)`` goes through the
    CachingHostAllocator, which rounds every block up to a power of two (up to
    ~2x host RAM for odd activation sizes). Registering an exact-size pageable
    allocation with cudaHostRegister keeps the host footprint at the bytes we
    store. Returns False (and registers nothing) when it is unavailable or fails;
    a failure's CUDA error is cleared before returning (:func:`clear_last_cuda_error`).
    """
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    try:
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    except Exception:
        clear_last_cuda_error()
        return False
    if int(rc) != 0:
        clear_last_cuda_error()
        return False
    return True


def unregister_host_memory(t: torch.Tensor) -> None:
    """Undo :func:`register_host_memory` before the tensor's memory is freed (a failure's CUDA
    error is cleared, as for registration)."""
    try:
        rc = torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:
        rc = -1
    if int(rc) != 0:
        clear_last_cuda_error()


# NOTE [ Sticky last error ]
# torch.cuda.cudart()'s cudaHostRegister/cudaHostUnregister return the cudaError_t
# but leave it in the CUDA runtime's per-thread "last error" (torch wraps the bare call,
# C10_CUDA_ERROR_HANDLED). Every kernel launch afterwards checks cudaGetLastError()
# (C10_CUDA_KERNEL_LAUNCH_CHECK), so the next unrelated launch on this thread would
# raise our handled registration failure as its own error. torch binds no
# cudaGetLastError, so it is called through ctypes on the libcudart that torch loaded
# (the same runtime instance, found in /proc/self/maps); where that library cannot be
# found, one tiny kernel launch consumes the error instead (its check raises it once,
# and cudaGetLastError resets it).


@functools.cache
def _cuda_get_last_error() -> Callable[[], int] | None:
    """cudaGetLastError of the libcudart this process loaded, or None (static or no cudart)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.isfile(path):
            try:
                fn = ctypes.CDLL(path).cudaGetLastError
            except (OSError, AttributeError):
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = []
            return fn
    return None


def clear_last_cuda_error() -> int | None:
    """Reset this thread's CUDA last error after a runtime call whose failure was handled.

    See NOTE [ Sticky last error ]. Returns the error code it cleared (0: none was set), or
    None when it could only launch a kernel to consume it.
    """
    get_last_error = _cuda_get_last_error()
    if get_last_error is not None:
        return int(get_last_error())
    try:
        torch.zeros(1, device="cuda")  # its launch check reads (and so resets) the last error
        torch.zeros(1, device="cuda")
    except Exception:
        pass
    return None


_NO_HOST_CACHE_LOGGED = False


def empty_host_cache() -> bool:
    """Hand the caching host allocator's free pinned blocks back to CUDA; False when this
    torch offers no way to (then they stay cached until the process exits).

    Why private: the public ``torch.accelerator.empty_host_cache()`` is new (torch 2.13; not
    in 2.11, the GPU machine's torch); before it only ``torch._C._host_emptyCache()`` does
    this (torch's own cuda/graphs.py uses it). Without either, every pinned chunk the pool
    releases stays cached, and across engines that reaches tens of GiB of pinned memory.
    """
    global _NO_HOST_CACHE_LOGGED
    public = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    fn = public if public is not None else getattr(torch._C, "_host_emptyCache", None)
    if fn is None:
        if not _NO_HOST_CACHE_LOGGED:
            _NO_HOST_CACHE_LOGGED = True
            logger.warning("torch %s has neither torch.accelerator.empty_host_cache nor "
                           "torch._C._host_emptyCache: released pinned chunks stay in PyTorch's "
                           "host cache until the process exits", torch.__version__)
        return False
    try:
        fn()
    except Exception as e:  # no accelerator initialised: nothing is cached
        logger.debug("empty_host_cache: %s: %s", type(e).__name__, e)
        return False
    return True


def neg_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` with the lazy negation bit set (the inverse of resolving it).

    Why private: a saved tensor can carry the neg bit (e.g. the imaginary part
    of a conjugate view); the engine copies raw storage bytes, so it must set
    the bit again on the reloaded view, and only ``torch._neg_view`` does that.
    """
    return torch._neg_view(t)


_EMPTY: dict[torch.device, torch.Tensor] = {}
"""One empty tensor per device: what a version tracker's data is swapped for."""


def version_tracker(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor | None:
    """An empty tensor that shares ``t``'s version counter but not its storage.

    Why private: autograd keeps no version counter for tensors saved through
    hooks, and the engine must raise autograd's in-place error even when every
    Python reference to the saved tensor is gone (a temporary). A detached
    alias shares the version counter; assigning its ``.data`` an empty tensor
    then drops its storage (so the source memory can still be freed) and keeps
    the shared counter: ``set_data`` shallow-copies the new data into the alias
    without touching its version counter (an implementation detail of
    ``Tensor.data``'s setter). Unlike ``set_()`` it never bumps the counter, so
    the version that another thread (or autograd's own check of a tensor saved
    without hooks) reads at the same time is never off by one. Returns None
    when the tensor does not allow it (the caller falls back to a weak
    reference to the tensor).
    """
    try:
        if device is None:
            device = t.device
        empty = _EMPTY.get(device)
        if empty is None or type(t) is _FAKE_TENSOR:
            # A fake tensor (offload.predict) gets a fake empty of its own mode, never cached: a
            # real tensor must not be given a fake one, nor a fake one from another mode.
            empty = torch.empty(0, device=device)
            if type(t) is not _FAKE_TENSOR:
                _EMPTY[device] = empty
        tracker = t.detach()
        tracker.data = empty
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        return None
    return tracker


def profiler_enabled() -> bool:
    """True while a torch (autograd/kineto) profiler is recording on this process.

    Why private: ``record_function`` costs a dispatcher call even with no
    profiler running; the engine's hooks run once per saved tensor, so they
    open their trace ranges only when this cheap flag says someone listens.
    """
    return torch._C._autograd._profiler_enabled()


def top_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost (pack, unpack) saved-tensors hooks of this thread, or None.

    Why private: ``offload.attach`` repairs an engine left entered by a
    ``KeyboardInterrupt`` in forward (forward hooks do not run for a
    BaseException); it may only pop the hooks if they are still the engine's.
    """
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def remove_saved_tensors_hooks(owns: Callable[[Callable], bool]) -> bool:
    """Remove the innermost (pack, unpack) pair of this thread whose pack hook ``owns`` accepts, leaving
    every pair above it in place and in order; False (the stack as it was) when there is none.

    Why private: the hook stack is push/pop only. An engine left while a context entered inside it is
    still open (a misnested ``__exit__``) must take its own hooks out from under that context's without
    removing them: the pairs above are popped and pushed back, the same objects in the same order, so
    that context still runs innermost and its own exit pops them.
    """
    autograd = torch._C._autograd
    above: list[tuple[Callable, Callable]] = []
    found = False
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        autograd._pop_saved_tensors_default_hooks()
        if owns(top[0]):
            found = True
            break
        above.append(top)
    for pack, unpack in reversed(above):
        autograd._push_saved_tensors_default_hooks(pack, unpack)
    return found


# The hooks run once per saved tensor: they call the C functions themselves
# (the same calls as ``graph_task_id`` / ``profiler_enabled`` above, which say
# why each is private), without a Python frame around them.
graph_task_id_c: Callable[[], int] = torch._C._current_graph_task_id
"""``graph_task_id`` without its Python frame."""
profiler_enabled_c: Callable[[], bool] = torch._C._autograd._profiler_enabled
"""``profiler_enabled`` without its Python frame."""
top_saved_tensors_hooks_c: Callable[[], "tuple[Callable, Callable] | None"] = functools.partial(
    torch._C._autograd._top_saved_tensors_default_hooks, False)
"""``top_saved_tensors_hooks`` without its Python frame (``offload.modules`` asks it at each module
call while an engine is entered: NOTE [ Nested hooks ] in offload/_foreign_hooks.py)."""


_SANITIZER_CORE = None


def sanitizer_core():
    """``torch.cuda._sanitizer``'s classes (``EventHandler``, ``ArgumentHandler``, its errors) as a module,
    loaded without the import's side effect.

    Why private: the happens-before checker (``offload.testing``) reuses the core of PyTorch's CUDA
    sanitizer, which exists only in that private module. Importing it runs ``cuda_sanitizer =
    CUDASanitizer()``, which activates the GPU trace (``torch._C._activate_gpu_trace``) and registers ten
    Python callbacks in ``torch.cuda._gpu_trace``: from then on every caching-allocator allocation and
    free, every event record and wait of the whole process calls into Python and walks the Python stack
    (16-38 us each), whether or not anything checks. The checker needs none of that (it is fed from a
    dispatch mode on CPU tensors), so the module is executed here under a private name with the
    activation and the registrations suppressed for the duration of its body. A process that turned the
    sanitizer on itself (``TORCH_CUDA_SANITIZER=1``: already imported) gets that module as it is, and a
    later ``import torch.cuda._sanitizer`` by anyone still runs the real one.
    """
    global _SANITIZER_CORE
    if _SANITIZER_CORE is not None:
        return _SANITIZER_CORE
    import importlib.util
    import sys

    loaded = sys.modules.get("torch.cuda._sanitizer")
    if loaded is not None:
        _SANITIZER_CORE = loaded
        return loaded
    import torch.cuda._gpu_trace as gpu_trace

    spec = importlib.util.find_spec("torch.cuda._sanitizer")
    name = "offload._sanitizer_core"
    spec = importlib.util.spec_from_file_location(name, spec.origin)
    module = importlib.util.module_from_spec(spec)
    registrars = {n: getattr(gpu_trace, n) for n in dir(gpu_trace) if n.startswith("register_callback_for_")}
    activate = torch._C._activate_gpu_trace
    sys.modules[name] = module  # dataclasses look their module up while the body runs
    try:
        torch._C._activate_gpu_trace = lambda: None
        for n in registrars:
            setattr(gpu_trace, n, lambda cb: None)
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        torch._C._activate_gpu_trace = activate
        for n, fn in registrars.items():
            setattr(gpu_trace, n, fn)
    _SANITIZER_CORE = module
    return module


def cuda_allocated_and_peak(index: int) -> tuple[int, int]:
    """(bytes allocated now, their peak) of CUDA device ``index``'s caching allocator: host-side
    counters, no device synchronization.

    Why private: ``torch.cuda.memory_allocated`` and ``max_memory_allocated`` each build and flatten
    the allocator's whole statistics dictionary in Python (~100 entries, tens of microseconds);
    the copy schedule reads these two numbers during backward, so it takes them from one call of
    the nested dictionary ``torch.cuda.memory_stats`` itself is built from.
    """
    stats = torch._C._cuda_memoryStats(index)["allocated_bytes"]["all"]
    return int(stats["current"]), int(stats["peak"])


def extension_build_dir(name: str) -> str:
    """The directory ``torch.utils.cpp_extension.load(name=name)`` builds and caches in (made if missing).

    Why private: ``offload._native`` must look at that directory before the build (is the extension
    already built? a lock left by a killed build?), and only ``_get_build_directory`` knows torch's rule
    for it (``TORCH_EXTENSIONS_DIR``, else a folder per Python version and accelerator).
    """
    from torch.utils import cpp_extension

    return cpp_extension._get_build_directory(name, verbose=False)


def function_modes() -> list[object]:
    """The torch-function modes entered on this thread, outermost first.

    Why private: ``offload.tiling.tile_loss`` enters its mode (``offload._logits_watch.LogitsWatch``) when the
    model's head returns and leaves it at the loss, two calls apart, so it cannot use a ``with`` block; it
    pops it only where it is the innermost mode, and must read the stack to know (torch exposes only
    ``_get_current_function_mode_stack``, and ``TorchFunctionMode.__exit__`` pops whatever is on top).
    """
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
