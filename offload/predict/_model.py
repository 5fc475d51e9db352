"""Building the model a capture runs: under fake tensors, cast, registered, with Hugging Face's mask code
kept on the path a real run takes, and the real model's state swapped for fake twins (NOTE [ Capture ]
in ``_capture.py``)."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..modules import register_model
from ..planner.blocks import find_blocks
from ._errors import PredictError
from ._fsdp import local

__all__ = ["fake_parameters", "quiet_third_party"]


class _FakeDeepCopy(TorchFunctionMode):
    """``copy.deepcopy`` of a fake tensor, in the running fake mode: torch's own makes the copy in a new
    fake mode, which the running one then refuses ("Mixing fake modes"), e.g. ``nn.TransformerEncoder``
    deep-copies its layer. Entered only while the model is built."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__deepcopy__ and type(args[0]) is FakeTensor:
            t, memo = args
            if id(t) not in memo:
                with torch.no_grad():
                    out = t.clone()
                out = nn.Parameter(out, t.requires_grad) if getattr(t, "_is_param", False) else \
                    out.requires_grad_(t.requires_grad)
                memo[id(t)] = out
            return memo[id(t)]
        return func(*args, **kwargs)


def _hf_masks_as_real(stack: contextlib.ExitStack) -> None:
    """Hugging Face's mask code treats a fake tensor as a sign of tracing and then builds an explicit
    causal mask (B x 1 x S x S, and GQA keys and values expanded for it) where a real run passes
    ``is_causal=True``. While capturing: a fake scalar (the query offset) is not "tracing", and
    sequences are not packed (default position ids; packing cannot be read from fake values). A fake
    padding mask still makes the explicit mask: its values are unknown (an assumption the prediction
    states)."""
    import sys

    mu = sys.modules.get("transformers.masking_utils")
    orig = getattr(mu, "is_tracing", None)
    packed = getattr(mu, "find_packed_sequence_indices", None)
    if orig is None or packed is None:
        return

    def is_tracing(tensor: Any = None) -> bool:
        return orig(None) if type(tensor) is FakeTensor and tensor.dim() == 0 else orig(tensor)

    def find_packed_sequence_indices(position_ids: Any, *args: Any, **kwargs: Any) -> Any:
        return None if type(position_ids) is FakeTensor else packed(position_ids, *args, **kwargs)

    for name, fn, old in (("is_tracing", is_tracing, orig),
                          ("find_packed_sequence_indices", find_packed_sequence_indices, packed)):
        setattr(mu, name, fn)
        stack.callback(setattr, mu, name, old)


def _cast(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters and buffers to ``dtype``, in place (``Module.to`` would swap fake
    parameters, which refuses tensors that are weakly referenced)."""
    with torch.no_grad():
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
            for k, b in m._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    m._buffers[k] = b.to(dtype)


def _stand_in_device(device: Any) -> Any:
    """``device`` with CUDA replaced by the capture's stand-in (CPU); anything else as it is."""
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.split(":")[0].strip().lower() == "cuda":
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a CUDA ordinal (Tensor.to(0), Module.cuda(0))
    return device


class _CudaOnStandIn(TorchFunctionMode):
    """While a capture runs, "cuda" means the GPU predicted, whose stand-in is the CPU (NOTE [ Capture ] item 1):
    ``.cuda()``, ``.to("cuda")``, ``device="cuda"`` and ``with torch.device("cuda")`` in ``model_fn`` or
    ``step_fn`` stay on the stand-in, as the same code puts the model on the GPU in a real run (a fake CUDA
    tensor would abort this CPU-only build in attention)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _stand_in_device(kwargs["device"])}
        if func is torch.Tensor.to:
            args = tuple(_stand_in_device(a) if i else a for i, a in enumerate(args))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _fake_module_conversion() -> Iterator[None]:
    """``Module.to``/``.cuda()``/``.half()`` on fake parameters, as on real ones: ``Module._apply`` swaps a fake
    parameter for its converted twin (``torch.utils.swap_tensors``), which refuses a tensor that is weakly
    referenced, and fake mode's converter references every fake parameter it makes ("Couldn't swap
    Linear.weight", e.g. in peft's ``get_peft_model``). While the model is built, a fake parameter that cannot
    be swapped takes its twin's data instead (``param.data = twin``, what ``_apply`` does for real tensors)."""
    import torch.utils as tu

    orig = tu.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor) and \
                (weakref.getweakrefcount(t1) or weakref.getweakrefcount(t2)):
            with torch.no_grad():
                t1.data = t2.data
            return
        orig(t1, t2)

    tu.swap_tensors = swap_tensors
    try:
        yield
    finally:
        tu.swap_tensors = orig


@contextlib.contextmanager
def quiet_third_party() -> Iterator[None]:
    """Third-party noise kept out of a prediction's output while the model is built (the first build of a
    Hugging Face model imports torchao through ``transformers.quantizers``, which logs a warning per compiled
    kernel it cannot load and torch's pytree deprecation warnings; peft calls deprecated transformers APIs):
    those loggers are raised to ERROR for the duration, their ``warnings`` ignored, and so are deprecation
    notices (``DeprecationWarning``, ``FutureWarning``: about APIs, not about what the step allocates)."""
    loggers = [logging.getLogger(n) for n in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            for mod in _NOISY_LOGGERS:
                warnings.filterwarnings("ignore", module=re.escape(mod) + r"(\.|$)")
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")
"""Loggers (and warning modules) whose import-time messages a prediction hides (``quiet_third_party``)."""


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``t``'s bytes: ``t`` itself, a ``DTensor`` by its local shard, another traceable
    wrapper subclass by its inner tensors (torchao's ``NF4Tensor``: the packed 4-bit data and its scalers, not
    a 16-bit tensor of its shape). This mode does not see the ops such a tensor runs on its inner tensors, so
    its op stands for them (NOTE [ One FSDP2 rank ] item 3)."""
    if type(t) is FakeTensor or type(t) is torch.Tensor or type(t) is nn.Parameter:
        return [t]
    t = local(t)
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ctx = t.__tensor_flatten__()
    return [x for n in names for x in _leaves(getattr(t, n))]


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in ``x``, each by the tensors that hold its bytes (``_leaves``)."""
    return [leaf for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor) for leaf in _leaves(t)]


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of ``tensors`` on this rank (a DTensor by its local shard, an NF4 weight by its packed data)."""
    return sum(leaf.numel() * leaf.element_size() for t in tensors for leaf in _leaves(t))


def _needs_twins(model: nn.Module) -> bool:
    """The model's state is not made of fake CPU tensors: built before the call (real tensors), or on the meta
    device; the capture then swaps it for fake twins (``fake_parameters``)."""
    return any(type(leaf) is not FakeTensor or leaf.device.type != "cpu"
               for t in (*model.parameters(), *model.buffers()) if t is not None for leaf in _leaves(t))


def _refuse_bitsandbytes(model: nn.Module) -> None:
    """A bitsandbytes layer is refused by name: it quantizes its weight when moved to a GPU, which a prediction
    on fake CPU tensors never does, so the weight would be counted at its unquantized size."""
    for name, m in model.named_modules():
        if type(m).__module__.split(".")[0] == "bitsandbytes":
            nbytes = sum(t.numel() * t.element_size() for t in m.parameters(recurse=False))
            raise PredictError(
                f"offload.predict: {name or type(model).__name__} is a bitsandbytes {type(m).__name__}, which "
                "quantizes its weight when the layer is moved to a GPU; a prediction runs on fake CPU tensors and "
                f"would count that weight at its unquantized size ({nbytes} bytes, about 4x a 4-bit one), so it "
                "refuses. Predict QLoRA with torchao NF4 base weights (torchao.quantization.to_nf4, as torchtune's "
                "QLoRA builders make them), which are counted at their stored size.")


def _build(model_fn: Callable[[], nn.Module], dtype: torch.dtype | None, fake: bool,
           stack: contextlib.ExitStack | None = None) -> tuple[nn.Module, bool]:
    """The model ``model_fn`` builds (fake, cast to ``dtype``, registered) and whether its state was swapped for
    fake twins (a model built before the call or on the meta device, with ``stack``: NOTE [ Capture ] item 7)."""
    with contextlib.ExitStack() as build:
        if fake:
            build.enter_context(_FakeDeepCopy())
            build.enter_context(_fake_module_conversion())
        build.enter_context(quiet_third_party())
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload.predict: model_fn() must return an nn.Module, got {type(model).__name__}")
    _refuse_bitsandbytes(model)
    twins = fake and stack is not None and _needs_twins(model)
    if twins:
        stack.enter_context(fake_parameters(model))
    if dtype is not None:
        _cast(model, dtype)
    register_model(model)
    return model, twins


def _block_names(model: nn.Module) -> list[str]:
    try:
        return [n for n, _ in find_blocks(model)]
    except ValueError:  # no nn.ModuleList: activations are grouped by module
        return []


@contextlib.contextmanager
def fake_parameters(model: nn.Module):
    """While inside (and inside a capture, whose fake mode makes them): ``model``'s parameters and buffers
    are fake ones of the same shape, stride, dtype and ``requires_grad`` (a tied weight stays one tensor);
    the real ones are put back on exit, untouched (NOTE [ Capture ] item 7)."""
    memo: dict[int, torch.Tensor] = {}
    undo: list[tuple[dict, str, Any]] = []

    def twin(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in memo:
            with torch.no_grad():
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            memo[id(t)] = nn.Parameter(f, t.requires_grad) if param else f
        return memo[id(t)]

    try:
        for m in model.modules():
            for table, param in ((m._parameters, True), (m._buffers, False)):
                for k, t in list(table.items()):
                    if t is not None:
                        undo.append((table, k, t))
                        table[k] = twin(t, param)
        yield model
    finally:
        for table, k, t in reversed(undo):
            table[k] = t
