"""Model presets for prediction: Hugging Face configs written out here (no hub download).

Each preset is a ``transformers`` config class with the values of the model's published
``config.json`` (the hub repository named in ``SOURCES``); ``preset_model_fn(name)`` builds the
causal-LM model from it (under ``predict_step`` that is on fake tensors: nothing is materialised) and
``preset_step_fn(seq, batch)`` is a training step on random tokens with ``labels`` (the loss inside
the model, as a Hugging Face trainer computes it). ``transformers`` is needed only to use a preset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["PRESETS", "SOURCES", "preset_config", "preset_model_fn", "preset_step_fn", "max_positions"]

SOURCES = {
    "llama3-8b": "meta-llama/Meta-Llama-3-8B config.json",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B config.json",
    "mistral-7b": "mistralai/Mistral-7B-v0.3 config.json (no sliding window)",
    "gpt2-xl": "openai-community/gpt2-xl config.json",
}
"""Preset -> the published config its values come from."""

_VALUES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001)),
    "qwen2.5-7b": ("Qwen2Config", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072, rope_theta=1000000.0,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, use_sliding_window=False,
        bos_token_id=151643, eos_token_id=151643)),
    "mistral-7b": ("MistralConfig", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, sliding_window=None,
        bos_token_id=1, eos_token_id=2)),
    "gpt2-xl": ("GPT2Config", dict(
        vocab_size=50257, n_embd=1600, n_layer=48, n_head=25, n_positions=1024, n_inner=None,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
        bos_token_id=50256, eos_token_id=50256)),
}
_MODELS = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
           "MistralConfig": "MistralForCausalLM", "GPT2Config": "GPT2LMHeadModel"}
PRESETS: tuple[str, ...] = tuple(_VALUES)
"""Preset names."""


def preset_config(name: str, *, layers: int | None = None) -> Any:
    """The preset's ``transformers`` config (``layers`` overrides the number of blocks)."""
    if name not in _VALUES:
        raise ValueError(f"offload.predict: preset {name!r} is not one of {PRESETS}")
    import transformers

    cls_name, values = _VALUES[name]
    cfg = getattr(transformers, cls_name)(**values)
    cfg.use_cache = False
    if layers is not None:
        setattr(cfg, "n_layer" if cls_name == "GPT2Config" else "num_hidden_layers", layers)
    return cfg


def max_positions(name: str) -> int:
    """Longest sequence the preset's position embedding covers."""
    values = _VALUES[name][1]
    return int(values.get("max_position_embeddings") or values["n_positions"])


def preset_model_fn(name: str, *, layers: int | None = None) -> Callable[[], nn.Module]:
    """``model_fn`` for ``predict_step``: the preset's causal-LM model, SDPA attention."""
    cfg = preset_config(name, layers=layers)

    def model_fn() -> nn.Module:
        import transformers

        cfg._attn_implementation = "sdpa"
        return getattr(transformers, _MODELS[type(cfg).__name__])(cfg)

    return model_fn


def preset_step_fn(vocab_size: int, batch: int = 1) -> Callable[[nn.Module, int], torch.Tensor]:
    """``step_fn(model, seq_len)``: random tokens as inputs and labels; returns the model's loss."""

    def step_fn(model: nn.Module, seq: int) -> torch.Tensor:
        tokens = torch.randint(0, vocab_size, (batch, seq))
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss

    return step_fn
