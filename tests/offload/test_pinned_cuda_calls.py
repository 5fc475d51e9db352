"""Pinned memory's CUDA calls, with CUDA stubbed (issue 36 item 4): released pinned chunks go back
to CUDA on every supported torch (2.11 has only ``torch._C._host_emptyCache``), and a failed
cudaHostRegister/cudaHostUnregister clears CUDA's last error before anything else runs.

These check the call sequence on CPU; that the real calls behave so on a GPU is unverified until a
GPU run (``tests/offload/test_gpu_offload.py::test_gpu_many_pinned_engines_in_sequence``).
"""

from __future__ import annotations

import types
import weakref

import pytest
import torch

import offload._pinned
from offload import _torch_private
from offload.pool import HostPool


class _PinnedTorch:
    """``torch`` inside offload._pinned with pinned allocations that succeed on CPU (plain memory),
    each one logged; everything else is real torch."""

    def __init__(self, calls: list) -> None:
        self._calls = calls

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, pin_memory: bool = False, **kwargs):
        if pin_memory:
            self._calls.append("torch.empty(pin_memory=True)")
        return torch.empty(*args, **kwargs)


def _torch_like_2_11(monkeypatch, calls: list, chunks: list) -> None:
    """torch.accelerator without empty_host_cache, and torch._C._host_emptyCache logging whether
    the chunks made so far were already freed when it ran."""
    monkeypatch.setattr(torch, "accelerator", types.SimpleNamespace())
    monkeypatch.setattr(torch._C, "_host_emptyCache",
                        lambda: calls.append(("_host_emptyCache", [c() is None for c in chunks])),
                        raising=False)


def test_released_pinned_chunks_are_returned_on_torch_2_11(monkeypatch):
    """Without torch.accelerator.empty_host_cache (torch 2.11), pool.clear() hands the freed pinned
    blocks back through torch._C._host_emptyCache, after the chunks' memory is dropped."""
    calls: list = []
    chunks: list = []
    monkeypatch.setattr(offload._pinned, "torch", _PinnedTorch(calls))
    _torch_like_2_11(monkeypatch, calls, chunks)
    pool = HostPool(pin=True, device_type="cuda")
    buf = pool.take(1 << 16)
    assert buf is not None and buf.pinned
    chunks.append(weakref.ref(pool._arena.chunks[next(iter(pool._arena.chunks))].tensor.untyped_storage()))
    pool.give(buf)
    del buf
    pool.clear()
    assert calls == ["torch.empty(pin_memory=True)", ("_host_emptyCache", [True])], calls
    assert pool.reserved_bytes == 0


class _SyncingTorch(_PinnedTorch):
    """``_PinnedTorch`` whose ``torch.cuda`` is initialised and logs ``synchronize``."""

    def __init__(self, calls: list) -> None:
        super().__init__(calls)
        self.cuda = types.SimpleNamespace(is_initialized=lambda: True,
                                          synchronize=lambda *a, **k: calls.append("synchronize"))


def test_relayout_synchronizes_before_returning_the_first_steps_blocks(monkeypatch):
    """The first step's chunks, released by the re-layout at its end, go back to CUDA only after a
    device synchronize: torch's host allocator keeps a freed block that a stream used out of its free
    list until events recorded at the free complete, and looks at them only in a later allocation or
    empty_cache, neither of which comes (the pool allocates nothing after the first step). The
    synchronize comes after the chunks are dropped and before the cache is emptied; a pool that
    releases nothing calls neither."""
    calls: list = []
    chunks: list = []
    monkeypatch.setattr(offload._pinned, "torch", _SyncingTorch(calls))
    _torch_like_2_11(monkeypatch, calls, chunks)
    pool = HostPool(pin=True, device_type="cuda")
    sizes = [(3 << 16) + 4096 * i for i in range(12)]  # odd sizes: growth guesses, re-layout fixes
    bufs = [pool.take(n) for n in sizes]
    assert all(b is not None and b.pinned for b in bufs)
    chunks.extend(weakref.ref(c.tensor.untyped_storage()) for c in pool._arena.chunks.values())
    first = len(chunks)
    for b in bufs:
        pool.give(b)
    del bufs, b
    pinned_before = calls.count("torch.empty(pin_memory=True)")
    pool.trim()  # the end of the first step
    assert pool._relayouts == 1, "the first step's chunks were not re-laid out: the test proves nothing"
    i = calls.index("synchronize")
    assert ("_host_emptyCache", [True] * first) in calls[i + 1:], calls
    assert calls.count("torch.empty(pin_memory=True)") > pinned_before  # the new layout was pinned
    # A later step with the same requests allocates and releases nothing: no sync, no emptying.
    n = len(calls)
    bufs = [pool.take(s) for s in sizes]
    for b in bufs:
        pool.give(b)
    pool.trim()
    assert calls[n:] == [], calls[n:]


def test_public_empty_host_cache_is_preferred(monkeypatch):
    """Where torch has the public torch.accelerator.empty_host_cache, it is used, not the private one."""
    calls: list = []
    monkeypatch.setattr(torch, "accelerator",
                        types.SimpleNamespace(empty_host_cache=lambda: calls.append("public")))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("private"), raising=False)
    assert _torch_private.empty_host_cache() is True
    assert calls == ["public"]


def test_no_way_to_empty_the_host_cache_is_logged_once(monkeypatch, caplog):
    """A torch with neither API says once (logging) that pinned blocks stay cached; nothing raises."""
    monkeypatch.setattr(torch, "accelerator", types.SimpleNamespace())
    monkeypatch.delattr(torch._C, "_host_emptyCache", raising=False)
    monkeypatch.setattr(_torch_private, "_NO_HOST_CACHE_LOGGED", False)
    with caplog.at_level("WARNING", logger="offload.pinned"):
        assert _torch_private.empty_host_cache() is False
        assert _torch_private.empty_host_cache() is False
    msgs = [r.getMessage() for r in caplog.records if "_host_emptyCache" in r.getMessage()]
    assert len(msgs) == 1 and "stay in PyTorch's host cache" in msgs[0], msgs


class _Cudart:
    """torch.cuda.cudart() with cudaHostRegister/Unregister returning ``rc``, each call logged."""

    def __init__(self, calls: list, rc: int) -> None:
        self.calls, self.rc = calls, rc

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
        self.calls.append("cudaHostRegister")
        return self.rc

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append("cudaHostUnregister")
        return self.rc


def _stub_cuda(monkeypatch, calls: list, rc: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart(calls, rc))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("synchronize"))
    monkeypatch.setattr(_torch_private, "_cuda_get_last_error",
                        lambda: (lambda: calls.append("cudaGetLastError") or rc))


@pytest.mark.parametrize("rc", [1, 712], ids=["invalid_value", "already_registered"])
def test_failed_host_register_clears_the_cuda_error_before_the_fallback(monkeypatch, rc):
    """A failed cudaHostRegister (pin_allocator="exact") is followed at once by cudaGetLastError,
    before the fallback pinned allocation (or any launch) can trip over the stale error."""
    calls: list = []
    _stub_cuda(monkeypatch, calls, rc)
    monkeypatch.setattr(offload._pinned, "torch", _PinnedTorch(calls))
    tensor, registered = offload._pinned.pinned_chunk(1 << 16, "exact", "cuda")
    assert not registered and tensor.numel() == 1 << 16
    assert calls == ["cudaHostRegister", "cudaGetLastError", "torch.empty(pin_memory=True)"], calls


def test_failed_host_unregister_clears_the_cuda_error(monkeypatch):
    """A failed cudaHostUnregister (a dropped "exact" chunk) clears the error it left, right after it."""
    calls: list = []
    _stub_cuda(monkeypatch, calls, 1)
    offload._pinned._unregister(torch.empty(16, dtype=torch.uint8))
    assert calls == ["synchronize", "cudaHostUnregister", "cudaGetLastError"], calls


def test_successful_host_register_leaves_the_error_state_alone(monkeypatch):
    """Success: registered exactly, no error read (a real pending error is not swallowed by us)."""
    calls: list = []
    _stub_cuda(monkeypatch, calls, 0)
    tensor, registered = offload._pinned.pinned_chunk(1 << 16, "exact", "cuda")
    assert registered and tensor.data_ptr() % 4096 == 0
    assert calls == ["cudaHostRegister"], calls


def test_cudart_is_found_in_the_loaded_libraries(monkeypatch, tmp_path):
    """cudaGetLastError is called in the libcudart this process mapped (the runtime instance torch
    uses, listed in /proc/self/maps); a process that maps none gets None (then one launch clears it)."""
    import builtins
    import shutil
    import subprocess

    _torch_private._cuda_get_last_error.cache_clear()
    try:
        assert _torch_private._cuda_get_last_error() is None  # this CPU torch maps no libcudart
    finally:
        _torch_private._cuda_get_last_error.cache_clear()
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in libcudart")
    lib = tmp_path / "libcudart.so.13"
    src = tmp_path / "cudart.c"
    src.write_text("int cudaGetLastError(void) { static int e = 712; int r = e; e = 0; return r; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    real_open = builtins.open
    maps = f"7f0000000000-7f0000001000 r-xp 00000000 00:00 0 {lib}\n"

    def fake_open(path, *args, **kwargs):
        if path == "/proc/self/maps":
            import io
            return io.StringIO(maps)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    try:
        assert _torch_private.clear_last_cuda_error() == 712  # the error it cleared
        assert _torch_private.clear_last_cuda_error() == 0  # and it is cleared
    finally:
        _torch_private._cuda_get_last_error.cache_clear()
