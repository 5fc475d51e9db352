"""A training step whose model returns a KV cache: the engine warns once, naming the bytes held and
use_cache=False, whether it is entered with ``with`` or attached; nothing is said without a cache or without
gradients (offload/_kv_cache.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from offload import OffloadActivations
from offload._kv_cache import cache_bytes, returned_cache

transformers = pytest.importorskip("transformers")

V, B, S, LAYERS = 128, 2, 16, 2


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0))


def _kv_bytes(model: torch.nn.Module) -> int:
    """Keys and values of every layer for one B x S step, fp32: what the cache holds."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * LAYERS * B * heads * S * head_dim * 4


def _cache_warnings(model: torch.nn.Module, *, use_cache: bool, attach: bool, steps: int = 2) -> list[str]:
    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    engine = OffloadActivations(device="cpu", virtual_memory_safe_pct=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            if attach:
                with engine.attach(model):
                    loss = model(input_ids=tokens, labels=tokens, use_cache=use_cache).loss
            else:
                with engine:
                    loss = model(input_ids=tokens, labels=tokens, use_cache=use_cache).loss
            loss.backward()
    return [str(w.message) for w in caught if "KV cache" in str(w.message)]


@pytest.mark.parametrize("attach", [False, True], ids=["with", "attach"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_engine_warns_once_about_a_returned_kv_cache(kind, attach):
    """With use_cache=True the engine warns once over two steps, naming the cache's bytes and use_cache=False."""
    model = _model(kind)
    msgs = _cache_warnings(model, use_cache=True, attach=attach)
    kib = _kv_bytes(model) / 1024
    assert len(msgs) == 1, msgs
    assert f"{kib:.2f} KiB" in msgs[0] and "use_cache=False" in msgs[0]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_engine_says_nothing_without_a_cache(kind):
    """use_cache=False: no warning."""
    assert _cache_warnings(_model(kind), use_cache=False, attach=False) == []


def test_no_warning_without_gradients():
    """An evaluation forward under no_grad with a cache is not a training step: no warning."""
    model = _model("llama")
    tokens = torch.randint(0, V, (B, S))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), OffloadActivations(device="cpu"):
        warnings.simplefilter("always")
        model(input_ids=tokens, use_cache=True)
    assert not [w for w in caught if "KV cache" in str(w.message)]


def test_cache_bytes_reads_legacy_tuples_and_cache_objects():
    """cache_bytes counts each storage once, in a tuple of (key, value) pairs and in a transformers Cache."""
    k, v = torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)
    assert cache_bytes(((k, v), (k, v))) == 2 * k.nbytes
    model = _model("llama")
    out = model(input_ids=torch.randint(0, V, (B, S)), use_cache=True)
    assert cache_bytes(returned_cache(out)) == _kv_bytes(model)
