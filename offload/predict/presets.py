"""Model presets for prediction: Hugging Face configs written out here (no hub download).

Each preset is a ``transformers`` config class with the values of the model's published
``config.json`` (the hub repository named in ``SOURCES``); ``preset_model_fn(name)`` builds the
causal-LM model from it (under ``predict_step`` that is on fake tensors: nothing is materialised) and
``preset_step_fn(seq, batch)`` is a training step on random tokens with ``labels`` (the loss inside
the model, as a Hugging Face trainer computes it). ``model_config(name_or_path)`` takes a preset or the
path of a Hugging Face ``config.json`` (or of the folder holding it: a downloaded model), so any causal LM
``transformers`` knows can be predicted without its weights. ``transformers`` is needed only here: the
``hf`` extra (``pip install offload[hf]``; from a clone ``pip install -e ".[hf]"``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["PRESETS", "SOURCES", "EXTRA", "preset_config", "preset_model_fn", "preset_step_fn", "max_positions",
           "model_config", "config_model_fn", "config_max_positions", "model_label"]

EXTRA = "hf"
"""The extra (pyproject.toml) that installs ``transformers``, which every preset and config path needs."""

SOURCES = {
    "llama3-8b": "meta-llama/Meta-Llama-3-8B config.json",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B config.json (llama3 RoPE scaling, 131072 positions)",
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
    "llama3.1-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
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


def _transformers() -> Any:
    """``transformers``, or an ImportError naming the extra that installs it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            f"offload.predict.presets needs transformers (the presets and config.json paths are Hugging Face "
            f"models), which is not installed: pip install offload[{EXTRA}] (from a clone: "
            f'pip install -e ".[{EXTRA}]")', name="transformers") from e
    return transformers


def _with_layers(cfg: Any, layers: int | None) -> Any:
    cfg.use_cache = False
    if layers is not None:
        setattr(cfg, "n_layer" if hasattr(cfg, "n_layer") else "num_hidden_layers", layers)
    return cfg


def preset_config(name: str, *, layers: int | None = None) -> Any:
    """The preset's ``transformers`` config (``layers`` overrides the number of blocks)."""
    if name not in _VALUES:
        raise ValueError(f"offload.predict: preset {name!r} is not one of {PRESETS}")
    cls_name, values = _VALUES[name]
    return _with_layers(getattr(_transformers(), cls_name)(**values), layers)


def model_config(name_or_path: str | Path, *, layers: int | None = None) -> Any:
    """A preset's config, or the config at a path: a Hugging Face ``config.json`` or the folder holding one
    (read by ``transformers.AutoConfig``, no download). ``layers`` overrides the number of blocks."""
    if str(name_or_path) in _VALUES:
        return preset_config(str(name_or_path), layers=layers)
    path = Path(name_or_path).expanduser()
    if not (path.is_file() or (path / "config.json").is_file()):
        raise ValueError(f"offload.predict: model {str(name_or_path)!r} is neither a preset ({', '.join(PRESETS)}) "
                         "nor the path of a Hugging Face config.json (or of a folder holding one)")
    cfg = _transformers().AutoConfig.from_pretrained(str(path))
    return _with_layers(cfg, layers)


def model_label(name_or_path: str | Path) -> str:
    """A short name for file names and titles: the preset, or the config's folder (``.../Llama-3.1-8B``)."""
    if str(name_or_path) in _VALUES:
        return str(name_or_path)
    path = Path(name_or_path).expanduser().resolve()
    name = path.parent.name if path.is_file() else path.name
    return re.sub(r"[^\w.-]+", "_", name) or "model"


def config_max_positions(cfg: Any) -> int:
    """Longest sequence the config's position embedding covers."""
    return int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions"))


def max_positions(name: str) -> int:
    """Longest sequence the preset's position embedding covers."""
    values = _VALUES[name][1]
    return int(values.get("max_position_embeddings") or values["n_positions"])


def config_model_fn(cfg: Any) -> Callable[[], nn.Module]:
    """``model_fn`` for ``predict_step``: the config's causal-LM model (``AutoModelForCausalLM``), SDPA attention."""

    def model_fn() -> nn.Module:
        transformers = _transformers()
        cfg._attn_implementation = "sdpa"
        name = _MODELS.get(type(cfg).__name__)
        if name is not None:
            return getattr(transformers, name)(cfg)
        return transformers.AutoModelForCausalLM.from_config(cfg)

    return model_fn


def preset_model_fn(name: str, *, layers: int | None = None) -> Callable[[], nn.Module]:
    """``model_fn`` for ``predict_step``: the preset's causal-LM model, SDPA attention."""
    return config_model_fn(preset_config(name, layers=layers))


def preset_step_fn(vocab_size: int, batch: int = 1) -> Callable[[nn.Module, int], torch.Tensor]:
    """``step_fn(model, seq_len)``: random tokens as inputs and labels; returns the model's loss."""

    def step_fn(model: nn.Module, seq: int) -> torch.Tensor:
        tokens = torch.randint(0, vocab_size, (batch, seq))
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss

    return step_fn
