"""Mixed precision in a prediction: the step computes in a lower dtype while the state keeps the model's.

NOTE [ Mixed precision ]
1. What is predicted. ``mixed_precision=torch.bfloat16`` (or ``torch.float16``): parameters, gradients
   and optimizer state stay in the model's dtype (float32 as built, or ``dtype``), the compute runs in
   the given dtype. One GPU: the forward (``step_fn``) runs under ``torch.autocast`` and backward, the
   optimizer step and zeroing the gradients outside it, as ``torch.amp``, the HF Trainer's ``bf16=True``
   and Lightning's ``bf16-mixed`` run a step. ``world_size > 1``: FSDP2's
   ``MixedPrecisionPolicy(param_dtype=<dtype>, reduce_dtype=torch.float32)`` on every ``fully_shard``
   and no autocast, as torchtitan runs it (the all-gathered parameters are in the given dtype, the
   gradients are reduced in float32 into float32 shards).
2. CUDA's op lists, not CPU's. A capture runs on fake *CPU* tensors (NOTE [ Capture ] item 1), so the
   autocast that applies is CPU autocast, whose op lists differ from CUDA's: on CPU, softmax,
   log_softmax, layer_norm, group_norm, exp, pow, rsqrt, sum, cumsum, ... keep a bfloat16 input in
   bfloat16, where CUDA autocast runs them in float32 (a float32 output where a bf16 one is predicted
   would halve those tensors in the prediction), and mv, addmv, addr stay in float32 on CPU where
   CUDA runs them in the lower dtype. While a capture runs, the ops on which the two differ are given
   CUDA's policy at CPU autocast's dispatch key (``torch.library``, Python kernels at ``AutocastCPU``,
   registered when the capture starts and removed when it ends; the CPU kernels already registered
   there are left alone). The lists are CUDA's in ``aten/src/ATen/autocast_mode.cpp``
   (``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``); a cast is
   done as CUDA's is, above autograd, so autograd saves the cast tensor. The weight-cast cache of
   CUDA autocast applies to the lower-precision ops CPU autocast already has (linear, matmul, ...).
3. The report names the regime (``Prediction.precision``): "mixed bf16 (autocast; parameters,
   gradients and optimizer state in float32)", "FSDP2 MixedPrecisionPolicy(param_dtype=bf16,
   reduce_dtype=float32)", or the one dtype the whole step runs in.
4. A step written for the GPU. A ``torch.autocast("cuda", dtype=...)`` (or ``torch.cuda.amp.autocast``)
   that the step enters itself is CPU autocast in the same dtype while a capture runs (CUDA's default,
   float16, when it names none), with the policy of item 2: the step predicts as it runs on the GPU,
   where it would otherwise compute in float32 (autocast for CUDA leaves CPU tensors alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ._errors import PredictError

__all__ = ["check_mixed_precision", "cuda_autocast", "forward_autocast", "precision_words"]

aten = torch.ops.aten

_LOWER = ("addmv", "addr", "mv", "chain_matmul", "linalg_multi_dot", "einsum", "linalg_vecdot")
"""CUDA's lower-precision ops (``AT_FORALL_LOWER_PRECISION_FP``) that CPU autocast may leave alone."""
_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
         "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
         "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
         "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
         "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
         "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
         "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp")
"""CUDA's float32 ops (``AT_FORALL_FP32``)."""
_FP32_SET_OPT_DTYPE = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                       "linalg_vector_norm", "linalg_matrix_norm", "sum", "sum.dim_IntList")
"""CUDA's float32 ops with an output ``dtype`` argument (``AT_FORALL_FP32_SET_OPT_DTYPE``): run in float32
unless the caller named a dtype."""
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def check_mixed_precision(mixed_precision: Any, dtype: torch.dtype | None) -> torch.dtype | None:
    """``mixed_precision`` as a dtype (bfloat16 or float16) or None; a ``PredictError`` naming the argument
    otherwise."""
    if mixed_precision is None:
        return None
    if not isinstance(mixed_precision, torch.dtype):
        raise PredictError(f"offload.predict: mixed_precision={mixed_precision!r} must be a torch dtype: "
                           "torch.bfloat16 or torch.float16 (the dtype the step computes in), or None")
    if mixed_precision not in (torch.bfloat16, torch.float16):
        raise PredictError(f"offload.predict: mixed_precision={mixed_precision} is not a lower precision to compute "
                           "in: pass torch.bfloat16 or torch.float16 (parameters, gradients and optimizer state "
                           "stay in the model's dtype), or dtype= to run the whole step in one dtype")
    if dtype is not None and dtype.itemsize <= mixed_precision.itemsize:
        raise PredictError(f"offload.predict: dtype={dtype} with mixed_precision={mixed_precision}: the state would "
                           "be no wider than the compute. Leave dtype=None (the model's float32) for mixed precision, "
                           "or pass only dtype= for a step that runs entirely in that dtype")
    return mixed_precision


def precision_words(mixed_precision: torch.dtype | None, dtype: torch.dtype | None, world_size: int,
                    state_dtype: torch.dtype | None) -> str:
    """The regime a prediction ran, in words (NOTE [ Mixed precision ] item 3)."""
    state = _short(state_dtype) if state_dtype is not None else "the model's dtype"
    if mixed_precision is None:
        return (f"{_short(dtype)} throughout (dtype=: parameters cast, no autocast)" if dtype is not None
                else f"as built ({state} parameters, no autocast)")
    mp = _short(mixed_precision)
    if world_size > 1:
        return (f"mixed {mp}: FSDP2 MixedPrecisionPolicy(param_dtype={mp}, reduce_dtype=fp32), parameters, "
                f"gradients and optimizer state in {state}")
    return (f"mixed {mp}: the forward under autocast (CUDA's op lists), parameters, gradients and optimizer "
            f"state in {state}")


def _short(dtype: torch.dtype | None) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float64: "fp64"}.get(dtype, str(dtype))


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and \
        t.device.type == "cpu"


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda t: t.to(dtype) if _eligible(t) and t.dtype != dtype else t, tree)


def _kernel(op: Any, policy: str) -> Callable[..., Any]:
    dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        lower = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if policy == "lower":
                args, kwargs = _cast((args, kwargs), lower)
            elif policy == "fp32":
                args, kwargs = _cast((args, kwargs), torch.float32)
            elif args and _eligible(args[0]):  # fp32_set_opt_dtype: float32 unless the caller named a dtype
                if dtype_at is not None and len(args) > dtype_at:
                    if args[dtype_at] is None:
                        args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _overload(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet), overload or "default", None) if hasattr(aten, packet) else None


@contextlib.contextmanager
def cuda_autocast() -> Iterator[set[torch.dtype]]:
    """For a whole capture: CPU autocast with CUDA's policy on the ops where the two differ, and a step's own
    ``torch.autocast("cuda", ...)`` (``torch.cuda.amp.autocast``) as CPU autocast in the same dtype (CUDA's
    default float16 when none is named): NOTE [ Mixed precision ] items 2 and 4. Yields the set of dtypes an
    enabled autocast was entered with while it ran (the regime the report names)."""
    lib = torch.library.Library("aten", "IMPL")
    seen: set[torch.dtype] = set()
    cls = torch.amp.autocast_mode.autocast
    orig_init = cls.__init__

    def __init__(self: Any, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None) -> None:
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype if dtype is not None else torch.float16
        orig_init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        if enabled and device_type == "cpu":
            seen.add(self.fast_dtype)

    try:
        for names, policy in ((_LOWER, "lower"), (_FP32, "fp32"), (_FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype")):
            for name in names:
                op = _overload(name)
                if op is None or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "AutocastCPU"):
                    continue  # not in this torch, or CPU autocast already has a kernel for it
                lib.impl(name, _kernel(op, policy), "AutocastCPU")
        cls.__init__ = __init__  # type: ignore[method-assign]
        yield seen
    finally:
        cls.__init__ = orig_init  # type: ignore[method-assign]
        lib._destroy()


def forward_autocast(mixed_precision: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Around a captured forward (``step_fn``): autocast in ``mixed_precision`` (a no-op for None)."""
    if mixed_precision is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=mixed_precision)
