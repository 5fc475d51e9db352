"""A CPU-backed accelerator whose backward runs on autograd's device thread, as CUDA's does; the
scenarios of tests/offload/test_device_thread.py run here, in a fresh interpreter, one JSON line each.

Why a separate process: autograd starts its device threads once per process, at the first backward,
counting the devices registered then; the test session has run backwards long before. Why this
device: on CPU, backward runs on the calling thread, so every CPU test of the engine's unpack path
(an in-place error raised in the hook, the stash, prefetch) misses the thread a GPU runs it on. The
device ("devthread") is PrivateUse1 with a C++ device guard (one device), memory from the host
allocator, and every op run by ATen's CPU fallback; its streams are offload.testing's emulator
(events report "not done" for ``lag`` polls, so copies look in flight as on a GPU).

Usage: ``python device_thread_child.py SCENARIO [SCENARIO ...]`` (see ``SCENARIOS``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback

import torch
from torch.utils.cpp_extension import load_inline

_GUARD_AND_KERNELS = r'''
#include <torch/extension.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/set_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cstdlib>
#include <cstring>

namespace {
constexpr auto kDev = c10::DeviceType::PrivateUse1;

void host_free(void* p) { std::free(p); }

struct HostBackedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? std::aligned_alloc(64, (n + 63) / 64 * 64) : nullptr;
    return {p, p, &host_free, c10::Device(kDev, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &host_free; }
  void copy_data(void* dst, const void* src, std::size_t n) const override { std::memcpy(dst, src, n); }
};
HostBackedAllocator g_alloc;

// One device, one stream: what autograd needs to give the device a ready queue and a thread.
struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDev; }
  c10::Device exchangeDevice(c10::Device) const override { return c10::Device(kDev, 0); }
  c10::Device getDevice() const override { return c10::Device(kDev, 0); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kDev, 0));
  }
  c10::Stream exchangeStream(c10::Stream) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kDev, 0));
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

at::Tensor host_alias(const at::Tensor& t) {  // a CPU tensor over the same bytes
  if (t.device().type() == c10::DeviceType::CPU) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::kCPU));
}
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>,
                               std::optional<c10::MemoryFormat> mf) {
  return at::detail::empty_generic(size, &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), mf);
}
at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, &g_alloc,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  host_alias(dst).copy_(host_alias(self));
  return dst;
}
at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}
const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size, std::optional<c10::MemoryFormat> mf) {
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), mf);
}
at::Scalar local_scalar_dense(const at::Tensor& self) { return at::_local_scalar_dense(host_alias(self)); }
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { at::native::cpu_fallback(op, stack); }
}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("resize_", resize_);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("set_.source_Storage", at::native::set_);
  m.impl("set_.source_Storage_storage_offset", at::native::set_storage_cpu_);
  m.impl("_local_scalar_dense", local_scalar_dense);
}
TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

void register_allocator() { c10::SetAllocator(kDev, &g_alloc); }
'''

DEVICE = "devthread"


def register() -> torch.device:
    """Build (cached in torch's extension folder, outside the checkout) and register the device."""
    import torch.utils.backend_registration as br

    ext = load_inline("offload_devthread", cpp_sources=_GUARD_AND_KERNELS, functions=["register_allocator"])
    ext.register_allocator()
    torch.utils.rename_privateuse1_backend(DEVICE)
    torch.utils.generate_methods_for_privateuse1_backend()
    class _Module(br._DummyBackendModule):
        @staticmethod
        def get_amp_supported_dtype() -> list[torch.dtype]:  # checkpoint's recompute asks (autocast state)
            return [torch.float16, torch.bfloat16]

    torch._register_device_module(DEVICE, _Module())
    torch._C._acc.register_python_privateuseone_hook(br._DummyPrivateUse1Hook())
    return torch.device(DEVICE, 0)


class _ThreadOfBackward(torch.autograd.Function):
    """Identity that notes the thread its backward runs on."""

    seen: list[str] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _ThreadOfBackward.seen.append(threading.current_thread().name)
        return g


def _engine(device: torch.device, backend: str, **kwargs):
    from offload import OffloadActivations

    ctx = OffloadActivations(device=device, min_offload_size=0, use_pin_memory=False,
                             use_streams=backend == "streams", **kwargs)
    assert ctx.backend == ("stream" if backend == "streams" else "sync"), ctx.backend
    return ctx


def _expect_inplace_error(loss: torch.Tensor) -> str:
    try:
        loss.backward()
    except RuntimeError as e:
        if "modified by an inplace operation" not in str(e):
            raise AssertionError(f"backward raised the wrong error: {type(e).__name__}: {e}") from e
        return f"{type(e).__name__}: {str(e)[:80]}"
    raise AssertionError("backward did not raise the in-place error")


def thread(device: torch.device) -> str:
    a = torch.randn(8, device=device, requires_grad=True)
    _ThreadOfBackward.apply(a.exp()).sum().backward()
    names = set(_ThreadOfBackward.seen)
    assert names and threading.main_thread().name not in names, names
    return f"backward ran on {sorted(names)}"


def bitwise(device: torch.device, backend: str, *, checkpoint: bool = False, backwards: int = 1,
            **engine_kwargs) -> str:
    """A toy Llama step through the engine equals its twin's bit for bit, with unpacks on the device
    thread; nothing of the pool is left in use. ``checkpoint``: each block under non-reentrant
    checkpoint (recomputed in backward, on the device thread); ``backwards``: that many backward
    passes over one graph (``retain_graph``)."""
    import copy

    from bench.model import ToyLlama, ToyLlamaConfig, make_batch

    cfg = ToyLlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32)
    torch.manual_seed(0)
    model = ToyLlama(cfg).to(device)
    twin = copy.deepcopy(model)
    model.checkpoint_blocks = twin.checkpoint_blocks = checkpoint
    ctx = _engine(device, backend, **engine_kwargs)
    for seed in range(2):
        x, y = (t.to(device) for t in make_batch(cfg, 2, 16, seed=seed))
        with ctx:
            out = _ThreadOfBackward.apply(model(x))
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
        ref = torch.nn.functional.cross_entropy(twin(x).flatten(0, 1), y.flatten())
        for i in range(backwards):
            loss.backward(retain_graph=i + 1 < backwards)
            ref.backward(retain_graph=i + 1 < backwards)
        assert torch.equal(loss.cpu(), ref.cpu()), (float(loss), float(ref))
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad.cpu(), q.grad.cpu()), name
    offloaded = [r for r in ctx.ledger.records if r.decision == "offloaded"]
    assert offloaded, "nothing was offloaded: the test proves nothing"
    del loss, out
    assert ctx.pool.stats()["in_use_bytes"] == 0, ctx.pool.stats()
    assert threading.main_thread().name not in set(_ThreadOfBackward.seen), _ThreadOfBackward.seen
    tiers = str(ctx.ledger.summary()).rsplit("; tiers ", 1)[-1]
    return f"{len(offloaded)} offloaded (tiers {tiers}), grads bitwise"


def disk_tier(device: torch.device, backend: str) -> str:
    """The disk tier's writes and read-ahead (its own threads) with reloads on the device thread."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        detail = bitwise(device, backend, host_budget_bytes=4096, pageable_budget_bytes=0, disk_dir=d)
    assert "disk" in detail, detail
    return detail


def inplace_racing(device: torch.device, backend: str) -> str:
    """tests/offload/test_gpu_offload.py::test_gpu_inplace_write_racing_the_d2h_copy_raises."""
    a = torch.randn(1 << 12, device=device, requires_grad=True)
    with _engine(device, backend):
        x = a.exp()
        x.masked_fill_(a > 0, 0.5)
        loss = (x * x).sum()
    return _expect_inplace_error(loss)


def shared_reload_inplace(device: torch.device, backend: str) -> str:
    """tests/offload/test_gpu_offload.py::test_gpu_shared_reload_inplace_in_backward_raises."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_hardening import _ZeroInBackward

    a = torch.randn(64, 256, device=device, requires_grad=True)
    w = torch.randn(128, device=device, requires_grad=True)
    with _engine(device, backend):
        base = a * 1.5
        q, k = base[:, :128], base[:, 128:]
        loss = (q * w).sum() + _ZeroInBackward.apply(k).sum()
    return _expect_inplace_error(loss)


def plain_hook_error(device: torch.device) -> str:
    """torch's own path: an exception raised in a plain unpack hook on the device thread."""
    a = torch.randn(8, device=device, requires_grad=True)

    def unpack(t):
        raise RuntimeError("modified by an inplace operation (raised by a plain hook)")

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        loss = (a.exp() * 2).sum()
    return _expect_inplace_error(loss)


def checkpointed(device: torch.device, backend: str) -> str:
    """``offload_ac``'s shape: blocks recomputed in backward (on the device thread), their inputs offloaded."""
    return bitwise(device, backend, checkpoint=True)


def retain_graph(device: torch.device, backend: str) -> str:
    """Two backward passes over one graph: the second reloads what the first released nothing of."""
    return bitwise(device, backend, backwards=2)


SCENARIOS = {
    "thread": thread,
    "plain_hook_error": plain_hook_error,
    **{f"{f.__name__}[{b}]": (lambda f, b: lambda d: f(d, b))(f, b)
       for f in (bitwise, checkpointed, retain_graph, disk_tier, inplace_racing, shared_reload_inplace)
       for b in ("sync", "streams")},
}


def main(names: list[str]) -> None:
    from offload import streams
    from offload.testing import EmulatedAccelerator

    device = register()
    emulator = EmulatedAccelerator(late=False, lag=2, check=False, dispatch=False)
    with emulator:
        streams._DEVICE_MODULES.append((DEVICE, emulator))
        for name in names or list(SCENARIOS):
            try:
                detail, ok = SCENARIOS[name](device), True
            except BaseException as e:  # noqa: BLE001 (reported to the test, which fails on it)
                detail, ok = "".join(traceback.format_exception(e))[-3000:], False
            print(json.dumps({"scenario": name, "ok": ok, "detail": detail}), flush=True)
        streams._DEVICE_MODULES.remove((DEVICE, emulator))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: with a PrivateUse1 device thread alive it aborts now and then
    # ("terminate called without an active exception"), after every scenario has reported.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
