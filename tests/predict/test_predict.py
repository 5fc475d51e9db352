"""predict_step, Prediction and max_context: labelled predictions, fits against the GPU's usable memory,
and the longest context that fits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload.predict import GPUS, Prediction, max_context, predict_step
from offload.policy import _classify, storage_ptr

from predict_testkit import adamw, toy

from bench.model import ToyLlama, ToyLlamaConfig


def test_prediction_is_labelled_and_fits_by_the_usable_memory():
    """A Prediction says 'PREDICTED' and its GPU; fits flips when the GPU's memory drops below the peak."""
    model_fn, step_fn = toy()
    p = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="offload", optimizer=adamw)
    assert isinstance(p, Prediction) and p.fits and "PREDICTED" in repr(p) and "h100-sxm" in p.report()
    assert p.offloaded_bytes > 0 and p.host_bytes["pool"] >= p.offloaded_bytes // 2
    assert p.ledger_summary["offloaded_bytes"] == p.offloaded_bytes and p.to_dict()["kind"] == "predicted"
    assert any("attention" in a for a in p.assumptions)
    assert p.step_seconds > 0 and p.exposed_copy_seconds >= 0  # the timeline replayed the captured step
    small = dataclasses.replace(GPUS["h100-sxm"], memory_bytes=p.peak_bytes, reserve_bytes=1)
    assert not predict_step(model_fn, step_fn, gpu=small, strategy="offload", optimizer=adamw).fits


def test_dtype_casts_the_floating_parameters():
    """dtype=bfloat16 halves the parameter bytes at the peak."""
    model_fn, step_fn = toy()
    f32 = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none")
    bf16 = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", dtype=torch.bfloat16)
    assert bf16.breakdown_at_peak["parameter"] < 0.6 * f32.breakdown_at_peak["parameter"]


def test_optimizer_state_is_in_the_prediction():
    """With AdamW its two state tensors per parameter appear as optimizer bytes (about twice the parameters)."""
    model_fn, step_fn = toy()
    p = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", optimizer=adamw)
    params = p.breakdown_at_peak["parameter"]
    assert 1.9 * params <= p.breakdown_at_peak["optimizer"] <= 2.1 * params


def test_max_context_is_the_longest_length_that_fits():
    """max_context returns a length that fits while the next multiple does not."""
    cfg = ToyLlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=4096)

    def step(model: nn.Module, seq: int) -> torch.Tensor:
        tokens = torch.randint(0, 128, (1, seq))
        return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

    gpu = dataclasses.replace(GPUS["h100-sxm"], memory_bytes=24 << 20, reserve_bytes=0)
    kw = dict(gpu=gpu, strategy="none", start=256, multiple=128, limit=4096)
    n = max_context(lambda: ToyLlama(cfg), step, **kw)
    assert 128 <= n < 4096

    def fits(s: int) -> bool:
        return predict_step(lambda: ToyLlama(cfg), lambda m: step(m, s), gpu=gpu, strategy="none").fits

    assert fits(n) and not fits(n + 128)


def test_unknown_strategy_and_gpu_are_refused_with_the_choices():
    """A bad strategy or GPU name raises, naming the value and what is accepted."""
    model_fn, step_fn = toy()
    with pytest.raises(ValueError, match="strategy='fast'.*none"):
        predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="fast")
    with pytest.raises(ValueError, match="h100-sxn.*did you mean"):
        predict_step(model_fn, step_fn, gpu="h100-sxn")


def test_a_fake_tensor_is_classified_as_the_tensor_it_stands_for():
    """Differential: policy._classify gives a fake tensor the reason it gives its real twin (parameter,
    view of a parameter, buffer-free activation, too small), with the fake storage id for a pointer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def cases():
        lin = nn.Linear(64, 64)
        x = lin(torch.randn(8, 64))
        return [lin.weight, lin.weight.t(), x, x[:1, :2], torch.randn(4)]

    real = cases()
    with FakeTensorMode():
        fake = cases()
    dev = torch.device("cpu")
    for r, f in zip(real, fake):
        got = [_classify(t, dev, 64, False, {}, lambda p: "", None, storage_ptr(t), False) for t in (r, f)]
        assert got[0] == got[1], (r.shape, got)


def _short_toy():
    cfg = ToyLlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=4096)

    def step(model: nn.Module, seq: int) -> torch.Tensor:
        tokens = torch.randint(0, 128, (1, seq))
        return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

    return lambda: ToyLlama(cfg), step


def test_max_context_logs_a_line_per_probe_and_says_how_it_was_found(caplog):
    """Each probe of the search is an INFO line on the offload.predict logger (length, fits, predicted peak), and
    the answer, an int, carries its probes and its time."""
    import logging

    model_fn, step = _short_toy()
    gpu = dataclasses.replace(GPUS["h100-sxm"], memory_bytes=24 << 20, reserve_bytes=0)
    with caplog.at_level(logging.INFO, logger="offload.predict"):
        n = max_context(model_fn, step, gpu=gpu, strategy="none", start=256, multiple=128, limit=4096)
    lines = [r.getMessage() for r in caplog.records if r.name == "offload.predict"]
    assert isinstance(n, int) and n > 0 and n.seconds > 0
    assert len(lines) == len(n.probes) >= 2
    assert all("predicted peak" in line for line in lines)
    assert (n, True) in {(s, f) for s, f, _ in n.probes}


def test_max_context_answers_at_once_when_the_state_alone_does_not_fit():
    """When the weights, gradients and optimizer state alone exceed the GPU, the search stops after its first
    probe with 0 and a reason naming what the state needs."""
    model_fn, step = _short_toy()
    gpu = dataclasses.replace(GPUS["h100-sxm"], memory_bytes=1 << 20, reserve_bytes=0)
    n = max_context(model_fn, step, gpu=gpu, strategy="none", optimizer=adamw, start=1024, multiple=128,
                    limit=4096)
    assert n == 0 and len(n.probes) == 1
    assert "state alone" in n.reason and "GiB" in n.reason
