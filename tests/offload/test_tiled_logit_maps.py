"""Models that map their logits between the head and the loss (offload/_logits_watch.py): the tiled loss
applies the same map to each tile, or refuses before computing a loss, never a silently different one.

Granite divides its logits by ``logits_scaling``, Gemma 2 soft-caps them, Cohere multiplies them by
``logit_scale``: before the watch, ``tile_loss`` computed cross-entropy of the head's output as it was
for Granite (a different loss and gradients, no error) and refused the other two by configuration key.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import OffloadError, tile_loss
from offload._torch_private import function_modes

transformers = pytest.importorskip("transformers")
from test_tiling import FP32_RTOL, assert_close_grads, labels_step, rel_diff  # noqa: E402

V = 96
_SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)

# name: (config, model, the map's setting, its neutral value)
MAPPED = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", "logits_scaling", 4.0, 1.0),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "final_logit_softcapping", 0.05, None),
    "cohere": ("CohereConfig", "CohereForCausalLM", "logit_scale", 0.25, 1.0),
}


def _mapped_model(name: str, value) -> nn.Module:
    cfg_name, model_name, key, _, _ = MAPPED[name]
    cfg_cls, model_cls = getattr(transformers, cfg_name, None), getattr(transformers, model_name, None)
    if cfg_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    extra = dict(head_dim=8) if name == "gemma2" else {}
    cfg = cfg_cls(**_SMALL, **extra, **{key: value})
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    torch.manual_seed(0)
    return model_cls(cfg).train()


def _no_mode_left() -> bool:
    return not function_modes()


@pytest.mark.parametrize("name", sorted(MAPPED))
def test_a_models_logit_map_is_applied_to_every_tile(name):
    """Granite's scaling, Gemma 2's soft-cap, Cohere's scale: the tiled loss and every gradient are the
    untiled model's within fp32 rounding; the map changes the loss (so leaving it out would fail here); the
    watch leaves no torch-function mode behind."""
    value, neutral = MAPPED[name][3], MAPPED[name][4]
    model = _mapped_model(name, value)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, V, (2, 48))
    ref_loss, ref = labels_step(twin, ids)
    unmapped_loss, _ = labels_step(_mapped_model(name, neutral), ids)
    assert rel_diff(unmapped_loss, ref_loss) > 100 * FP32_RTOL, "the map must matter for this test to mean anything"
    handle = tile_loss(model, tokens=16)
    got_loss, got = labels_step(model, ids)
    assert handle.stats()["calls"] == 1 and handle.stats()["tiles"] == 6
    assert rel_diff(got_loss, ref_loss) <= FP32_RTOL
    assert_close_grads(got, ref, FP32_RTOL)
    assert _no_mode_left()


def test_a_soft_cap_under_autocast_matches_within_bf16_rounding():
    """bf16 autocast on CPU: the soft-capped tiles replay the cap in the forward's autocast state, in both
    passes: loss and gradients within bf16 rounding of the untiled step."""
    model = _mapped_model("gemma2", 0.05)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, V, (1, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref = labels_step(twin, ids)
        tile_loss(model, tokens=16)
        got_loss, got = labels_step(model, ids)
    assert rel_diff(got_loss, ref_loss) <= 2e-2
    assert_close_grads(got, ref, 5e-2)


class _Mapped(transformers.LlamaForCausalLM):
    """A causal LM whose forward applies ``logit_map`` to the head's output before its loss."""

    logit_map = None

    def forward(self, input_ids=None, labels=None, **kwargs):
        h = self.model(input_ids=input_ids).last_hidden_state
        logits = self.logit_map(self.lm_head(h))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def _custom(logit_map) -> nn.Module:
    cfg = transformers.LlamaConfig(**_SMALL)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = _Mapped(cfg).train()
    model.logit_map = logit_map
    model.register_buffer("cap", torch.tensor(1.5), persistent=False)
    return model


REPLAYED = {
    "affine": lambda m: (lambda z: 2 * z + 1),
    "cast_then_divide": lambda m: (lambda z: z.float() / 3),
    "soft_cap_by_a_buffer": lambda m: (lambda z: torch.tanh(z / m.cap) * m.cap),
    "clamp": lambda m: (lambda z: torch.clamp(z, -0.05, 0.05)),
    "casts_only": lambda m: (lambda z: z.to(torch.float32).contiguous()),
}


@pytest.mark.parametrize("kind", sorted(REPLAYED))
def test_elementwise_maps_with_scalar_operands_are_replayed(kind):
    """Any chain of elementwise ops whose other operands are numbers or one-element tensors (a buffer) is
    replayed on the tiles: loss and gradients as untiled."""
    model = _custom(None)
    model.logit_map = REPLAYED[kind](model)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, V, (2, 40))
    ref_loss, ref = labels_step(twin, ids)
    tile_loss(model, tokens=16)
    got_loss, got = labels_step(model, ids)
    assert rel_diff(got_loss, ref_loss) <= FP32_RTOL
    assert_close_grads(got, ref, FP32_RTOL)
    assert _no_mode_left()


def _inplace(z):
    return z.mul_(2)


REFUSED = {  # kind: (the map, what the error names)
    "log_softmax": (lambda m: (lambda z: z.log_softmax(-1)), "log_softmax"),
    "per_vocab_scale": (lambda m: (lambda z: z * torch.linspace(0.5, 1.5, V)), "mul.*stand-in"),
    "trainable_scale": (lambda m: (lambda z: z * m.temperature), "trainable operand"),
    "in_place": (lambda m: _inplace, r"mul_ \(in place\)"),
    "with_itself": (lambda m: (lambda z: z + z * 0.5), "with themselves"),
    "detached": (lambda m: (lambda z: z.detach()), "detach"),
    "shifted": (lambda m: (lambda z: z[:, :-1]), "getitem"),
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_maps_the_tiles_cannot_replay_are_refused_before_any_loss(kind):
    """A map that is not elementwise, or whose operand has a shape or a gradient of its own, or that writes
    in place or combines the logits with themselves: an OffloadError naming the op and the way out, no
    mode left behind, and the model still runs untiled after remove()."""
    model = _custom(None)
    model.temperature = nn.Parameter(torch.tensor(0.7))
    make, needle = REFUSED[kind]
    model.logit_map = make(model)
    ids = torch.randint(0, V, (1, 32))
    handle = tile_loss(model, tokens=8)
    with pytest.raises(OffloadError, match=needle) as ei:
        model(input_ids=ids, labels=ids)
    assert "tiled_loss=False" in str(ei.value)
    assert _no_mode_left()
    assert handle.stats()["calls"] == 0
    handle.remove()
    if kind not in ("shifted", "detached"):  # (these two fail untiled too: one position short, no gradient)
        model(input_ids=ids, labels=ids).loss.backward()


def test_a_named_library_that_cannot_apply_the_map_is_refused(fake_libraries):
    """impl="cut_cross_entropy" computes cross-entropy of the head's output as it is: with a model that maps
    its logits it raises naming the impl, instead of the library's (different) loss."""
    calls, _ = fake_libraries
    model = _mapped_model("granite", 4.0)
    ids = torch.randint(0, V, (1, 32))
    tile_loss(model, impl="cut_cross_entropy")
    with pytest.raises(OffloadError, match="impl='cut_cross_entropy'.*'auto' or 'builtin'"):
        model(input_ids=ids, labels=ids)
    assert calls["cut_cross_entropy"] == 0 and _no_mode_left()
