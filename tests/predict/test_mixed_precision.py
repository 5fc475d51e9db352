"""predict_step(mixed_precision=torch.bfloat16): the state stays in the model's dtype, the step computes in bf16
(autocast with CUDA's op lists on one GPU, FSDP2's MixedPrecisionPolicy over several), the fake run allocates
what the real run does, and the report names the regime (NOTE [ Mixed precision ] in offload/predict/_mixed.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from offload.predict import predict_step
from offload.predict._capture import capture
from offload.predict._memory import DeviceMemory, replay
from offload.predict._mixed import cuda_autocast, forward_autocast

from predict_testkit import CASES, adamw, toy

BF16 = torch.bfloat16


def _long_toy():
    """The toy Llama at 256 tokens: activations well above the state, so the peak is the forward's."""
    model_fn, _ = toy(n_layers=2, dim=64, max_seq_len=256)

    def step_fn(model: torch.nn.Module) -> torch.Tensor:
        tokens = torch.randint(0, 128, (4, 256))
        return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

    return model_fn, step_fn


def test_mixed_precision_keeps_the_state_and_halves_the_matmul_activations():
    """With mixed_precision=bf16 the parameters, gradients and AdamW state are the fp32 ones (same bytes as
    without it), the activations at the peak shrink (the matmul outputs are bf16) and the report says so."""
    model_fn, step_fn = _long_toy()
    fp32 = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", optimizer=adamw)
    mixed = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", optimizer=adamw, mixed_precision=BF16)
    pure = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", optimizer=adamw, dtype=BF16)
    assert mixed.state_bytes == fp32.state_bytes
    assert pure.state_bytes["parameter"] < 0.6 * mixed.state_bytes["parameter"]
    assert mixed.breakdown_at_peak["activation"] < 0.8 * fp32.breakdown_at_peak["activation"]
    assert "mixed bf16" in mixed.precision and "fp32" in mixed.precision and "mixed" not in fp32.precision
    assert any("mixed bf16" in a for a in mixed.assumptions) and "mixed bf16" in mixed.report()


@pytest.mark.parametrize("strategy", ["none", "ac", "offload"])
def test_fake_mixed_precision_run_is_the_real_run(strategy):
    """Fake and real runs under mixed precision: the same ledger records and the same device peak, by category."""
    model_fn, step_fn = CASES["toy_llama"]()
    kw = dict(strategy=strategy, optimizer=adamw, mixed_precision=BF16)
    real = capture(model_fn, step_fn, fake=False, **kw)
    fake = capture(model_fn, step_fn, fake=True, **kw)
    assert fake.records == real.records
    assert replay(fake.trace).breakdown_at_peak() == replay(real.trace).breakdown_at_peak()


def test_mixed_precision_peak_matches_memtracker_under_autocast():
    """The predicted peak of a mixed-precision step is within 2% of what torch's MemTracker measures for the
    same step run for real under CPU autocast (the toy's ops are on both CPU's and CUDA's lists alike)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model_fn, step_fn = _long_toy()
    model = model_fn()
    opt = adamw(model.parameters())

    def step() -> None:
        with torch.autocast("cpu", dtype=BF16):
            loss = step_fn(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with MemTracker() as mt:
        mt.track_external(model, opt)
        step()
    measured = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    cap = capture(model_fn, step_fn, strategy="none", optimizer=adamw, fake=True, mixed_precision=BF16)
    predicted = replay(cap.trace, DeviceMemory(round_bytes=1)).peak_bytes
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_cpu_autocast_takes_cuda_op_lists_inside_a_capture_only():
    """Inside cuda_autocast, softmax, log_softmax and layer_norm of a bf16 input run in fp32 and mv in bf16, as
    CUDA autocast runs them (CPU autocast alone keeps the first three in bf16 and mv in fp32); outside, CPU
    autocast is unchanged."""
    x = torch.randn(4, 8, dtype=BF16)
    v = torch.randn(8)

    def dtypes() -> tuple:
        with forward_autocast(BF16):
            return (F.softmax(x, -1).dtype, F.log_softmax(x, -1).dtype, F.layer_norm(x, (8,)).dtype,
                    torch.mv(x.float(), v).dtype)

    assert dtypes() == (BF16, BF16, BF16, torch.float32)
    with cuda_autocast():
        assert dtypes() == (torch.float32, torch.float32, torch.float32, BF16)
    assert dtypes() == (BF16, BF16, BF16, torch.float32)


def test_cuda_policy_keeps_gradients_flowing():
    """A cast under the CUDA policy is recorded by autograd: the input's gradient exists and has its dtype."""
    x = torch.randn(4, 8, dtype=BF16, requires_grad=True)
    with cuda_autocast(), forward_autocast(BF16):
        F.softmax(x, -1).sum().backward()
    assert x.grad is not None and x.grad.dtype == BF16


def test_fsdp2_mixed_precision_gathers_bf16_and_keeps_fp32_shards():
    """world_size > 1 with mixed_precision: FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32):
    the shards, gradients and optimizer state are the fp32 ones, the unsharded (all-gathered) parameters at the
    peak about half as large, and the report names the policy."""
    model_fn, step_fn = toy(n_layers=2, dim=64)
    kw = dict(gpu="h100-sxm", strategy="ac", optimizer=adamw, world_size=4)
    fp32 = predict_step(model_fn, step_fn, **kw)
    mixed = predict_step(model_fn, step_fn, mixed_precision=BF16, **kw)

    def unsharded(p) -> int:
        return p.breakdown_at_peak["parameter"] - p.state_bytes["parameter"] - p.state_bytes["buffer"]

    assert mixed.state_bytes == fp32.state_bytes
    assert 0 < unsharded(mixed) <= 0.6 * unsharded(fp32), (unsharded(mixed), unsharded(fp32))
    assert "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)" in mixed.precision


def test_a_step_that_enters_cuda_autocast_predicts_as_mixed_precision():
    """A step written for the GPU, entering torch.autocast("cuda", dtype=torch.bfloat16) itself, predicts what
    mixed_precision=torch.bfloat16 predicts (not a float32 step: CUDA autocast would leave CPU tensors alone)."""
    model_fn, step_fn = _long_toy()

    def gpu_step(model: torch.nn.Module) -> torch.Tensor:
        with torch.autocast("cuda", dtype=BF16):
            return step_fn(model)

    own = predict_step(model_fn, gpu_step, gpu="h100-sxm", strategy="none", optimizer=adamw)
    given = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", optimizer=adamw, mixed_precision=BF16)
    assert own.peak_bytes == given.peak_bytes
    assert own.breakdown_at_peak == given.breakdown_at_peak
    assert own.precision == given.precision and "mixed bf16" in own.precision
