"""What a prediction reports beyond the peak: a returned KV cache as its own category, the output head kept on the
device by the engine strategies (or its share of the offloaded bytes), logits split out of "other", and the
predicted timeline written as a Chrome trace."""

from __future__ import annotations

import json

import pytest
import torch

from offload.predict import predict_step
from offload.predict._strategies import apply_strategy

from predict_testkit import CASES, adamw, hf

transformers = pytest.importorskip("transformers")


def _with_cache(kind: str, use_cache: bool):
    model_fn, step_fn = hf(kind)

    def build() -> torch.nn.Module:
        model = model_fn()
        model.config.use_cache = use_cache
        return model

    return build, step_fn


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_returned_kv_cache_is_its_own_category_and_an_assumption(kind):
    """With use_cache=True under checkpointing the cache's keys and values are kv_cache at the peak, named in the
    assumptions with use_cache=False, and the peak is above the same step's without a cache by about as much."""
    with_cache = predict_step(*_with_cache(kind, True), gpu="h100-sxm", strategy="ac")
    without = predict_step(*_with_cache(kind, False), gpu="h100-sxm", strategy="ac")
    assert with_cache.kv_cache_bytes > 0 and without.kv_cache_bytes == 0
    assert with_cache.breakdown_at_peak["kv_cache"] > 0 and without.breakdown_at_peak["kv_cache"] == 0
    assert any("KV cache" in a and "use_cache=False" in a for a in with_cache.assumptions)
    assert not any("KV cache" in a for a in without.assumptions)
    assert with_cache.peak_bytes > without.peak_bytes


@pytest.mark.parametrize("name", ["hf_llama", "toy_llama"])
def test_engine_strategies_keep_the_output_head_and_say_so(name):
    """strategy="offload" keeps the head (and what runs after it) on the device, as the trainer integrations do:
    nothing of the head is offloaded, its kept bytes are reported, and the report says so."""
    model_fn, step_fn = CASES[name]()
    p = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="offload", optimizer=adamw)
    assert p.head["name"] and p.head["offloaded_bytes"] == 0 and p.head["kept_bytes"] > 0
    assert "kept on the device" in p.head_share() and p.head_share() in p.report()
    assert any(a.startswith("output head: kept") for a in p.assumptions)


def test_an_offloaded_head_is_reported_as_its_share():
    """When the engine offloads the head too, the report gives its share of the offloaded bytes and how to keep it."""
    model_fn, step_fn = CASES["hf_llama"]()

    def offload_all(model: torch.nn.Module):
        return apply_strategy(model, "offload", None, keep_head=False)

    p = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy=offload_all, optimizer=adamw)
    assert 0 < p.head["offloaded_bytes"] < p.offloaded_bytes
    assert "exclude_output_head" in p.head_share() and "%" in p.head_share()


@pytest.mark.parametrize("name", ["hf_llama", "toy_llama"])
def test_logits_outside_the_modules_are_split_out_of_other(name):
    """Logits-shaped tensors made outside the model's modules (the toy's loss upcast in the step, both models'
    logit gradients in backward) are "logits", never "other", and the report defines the category."""
    from offload.predict._trace import Alloc

    model_fn, step_fn = CASES[name]()
    p = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none")
    vocab = 128  # predict_testkit's V, the heads' out_features
    logits = [it for it in p.trace.items if type(it) is Alloc and it.category == "logits"]
    assert logits and all(it.nbytes % (vocab * 4) == 0 for it in logits)
    if name == "hf_llama":  # its peak is in backward, with the logits' gradient alive
        assert p.breakdown_at_peak["logits"] > 0
    assert "logits: logits-shaped tensors" in p.report()


def test_write_trace_writes_the_predicted_timeline(tmp_path):
    """Prediction.write_trace writes a Chrome trace labelled predicted, with the GPU it assumed."""
    model_fn, step_fn = CASES["toy_llama"]()
    p = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="offload")
    path = tmp_path / "step.json"
    p.write_trace(str(path))
    trace = json.loads(path.read_text())
    assert trace["traceEvents"] and trace["metadata"]["predicted"] is True
    assert trace["metadata"]["gpu"] == "h100-sxm"
