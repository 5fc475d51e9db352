"""Every refusal of offload.predict names the argument, the value and what to do instead (issue 43): a GPU spec
with a bad field, an unknown GPU name, a dtype that is no floating torch dtype, a mixed precision that is not
lower, a call with gradients off, and a longest-context search with bad bounds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from offload.predict import GPUS, PredictError, max_context, predict_step, resolve_gpu

from predict_testkit import toy

H100 = GPUS["h100-sxm"]


@pytest.mark.parametrize("field, value", [
    ("peak_flops", {torch.bfloat16: 0.0}),
    ("peak_flops", {torch.bfloat16: -989e12}),
    ("peak_flops", {}),
    ("peak_flops", {"bfloat16": 989e12}),
    ("reserve_bytes", -1),
    ("reserve_bytes", H100.memory_bytes),
    ("reserve_bytes", 10 * H100.memory_bytes),
    ("launch_s", -4e-6),
    ("copy_latency_s", -1.0),
    ("copy_latency_s", float("nan")),
    ("memory_bytes", 1.5),
    ("memory_bytes", 0),
    ("memory_bytes", "80 gigs"),
    ("hbm_bytes_per_s", 0),
    ("h2d_bytes_per_s", float("inf")),
    ("matmul_efficiency", 1.5),
    ("copy_engines", 0),
    ("name", ""),
])
def test_gpu_spec_refuses_every_bad_field(field, value):
    """GPUSpec checks every field in __post_init__ and names the field in its ValueError (a zero peak would
    divide by zero in the replay; a negative reserve would make fits true for a step larger than the card)."""
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(H100, **{field: value})


def test_gpu_spec_reads_a_size_with_the_one_size_parser():
    """memory_bytes="80GiB" is 80 * 2**30 bytes, read by offload.sizes as every size in the project is."""
    spec = dataclasses.replace(H100, memory_bytes="80GiB", reserve_bytes="1GiB")
    assert spec.memory_bytes == 80 << 30 and spec.usable_bytes == 79 << 30


def test_gpu_name_suggests_the_cards_it_names():
    """gpu="h100" suggests both H100 variants (not the H200); spellings without the dash resolve."""
    with pytest.raises(ValueError) as e:
        resolve_gpu("h100")
    assert "'h100-sxm' or 'h100-pcie'" in str(e.value) and "did you mean 'h200'" not in str(e.value)
    assert resolve_gpu("h100sxm") is GPUS["h100-sxm"] and resolve_gpu("RTX_4090") is GPUS["rtx-4090"]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dtype="bfloat16"), TypeError, "dtype='bfloat16' must be a torch dtype"),
    (dict(dtype=torch.int8), PredictError, "dtype=torch.int8 is not a floating-point dtype"),
    (dict(mixed_precision="bf16"), PredictError, "mixed_precision='bf16' must be a torch dtype"),
    (dict(mixed_precision=torch.float32), PredictError, "mixed_precision=torch.float32 is not a lower precision"),
    (dict(dtype=torch.bfloat16, mixed_precision=torch.bfloat16), PredictError, "no wider than the compute"),
])
def test_predict_step_refuses_bad_precision_arguments(kwargs, error, match):
    """A dtype or mixed_precision that is not a floating torch dtype (or not lower than the state's) is refused
    before anything is built, naming the argument and what to pass."""
    model_fn, step_fn = toy()
    with pytest.raises(error, match=match):
        predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", **kwargs)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_predict_step_refuses_a_call_without_gradients(context):
    """Called under no_grad or inference_mode, predict_step says a training step needs autograd."""
    model_fn, step_fn = toy()
    with context(), pytest.raises(PredictError, match="gradients disabled"):
        predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none")


def test_predict_step_refuses_a_model_for_model_fn():
    """A model passed where a builder is expected is refused with the fix (lambda: model)."""
    model_fn, step_fn = toy()
    with pytest.raises(TypeError, match="lambda: model"):
        predict_step(model_fn(), step_fn, gpu="h100-sxm", strategy="none")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(multiple=64.5), TypeError, "multiple=64.5 must be an int"),
    (dict(start="1024"), TypeError, "start='1024' must be an int"),
    (dict(limit=0), ValueError, "limit=0 must be >= 1"),
    (dict(start=128, multiple=256), ValueError, "multiple <= start"),
])
def test_max_context_refuses_bad_bounds_before_running_the_step(kwargs, error, match):
    """max_context checks start, multiple and limit before any step runs (the step is never called)."""
    calls = []
    model_fn, _ = toy()
    with pytest.raises(error, match=match):
        max_context(model_fn, lambda m, s: calls.append(s), gpu="h100-sxm", strategy="none", **kwargs)
    assert not calls
