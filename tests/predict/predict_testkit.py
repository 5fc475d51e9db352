"""Small models that run for real on CPU and under fake tensors, each as (model_fn, step_fn)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bench.model import ToyLlama, ToyLlamaConfig

B, S, V = 2, 16, 128
Case = tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor]]


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, V, (B, S + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _lm_step(model: nn.Module) -> torch.Tensor:
    tokens, targets = _tokens()
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())


def _hf_step(model: nn.Module) -> torch.Tensor:
    tokens, _ = _tokens()
    return model(input_ids=tokens, labels=tokens).loss


def toy(n_layers: int = 2, dim: int = 64, max_seq_len: int = 64) -> Case:
    cfg = ToyLlamaConfig(vocab_size=V, dim=dim, n_layers=n_layers, n_heads=4, max_seq_len=max_seq_len)

    def model_fn() -> nn.Module:
        torch.manual_seed(0)
        return ToyLlama(cfg)

    return model_fn, _lm_step


def hf(kind: str) -> Case:
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    configs = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=2)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_key_value_heads=2)),
        # its MLP returns the router's scores too; Bloom's takes the residual (offload/_token_call.py)
        "gpt_oss": lambda: tf.GptOssForCausalLM(tf.GptOssConfig(**common, num_key_value_heads=2, head_dim=16,
                                                                num_local_experts=4, num_experts_per_tok=2)),
        "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=V, hidden_size=64, n_layer=2, n_head=4)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4,
                                                         n_positions=64)),
    }

    def model_fn() -> nn.Module:
        torch.manual_seed(0)
        m = configs[kind]()
        m.config.use_cache = False
        return m

    return model_fn, _hf_step


class Encoder(nn.Module):
    """torch's TransformerEncoder with an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(tokens)))


class ConvBN(nn.Module):
    """Convolutions with BatchNorm (running statistics are buffers written in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()) for _ in range(2))
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.flatten(1))


def _bn_step(model: nn.Module) -> torch.Tensor:
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    return F.cross_entropy(model(x), torch.arange(4))


class FrozenEmbedding(nn.Module):
    """A frozen embedding (no gradient) under trained MLP blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 64)
        self.emb.weight.requires_grad_(False)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
                                    for _ in range(2))
        self.head = nn.Linear(64, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def _built(cls: type) -> Callable[[], nn.Module]:
    def model_fn() -> nn.Module:
        torch.manual_seed(0)
        return cls()

    return model_fn


CASES: dict[str, Callable[[], Case]] = {
    "toy_llama": toy,
    "hf_llama": lambda: hf("llama"),
    "gpt2": lambda: hf("gpt2"),
    "qwen2": lambda: hf("qwen2"),
    "encoder": lambda: (_built(Encoder), _lm_step),
    "batchnorm": lambda: (_built(ConvBN), _bn_step),
    "frozen_embedding": lambda: (_built(FrozenEmbedding), _lm_step),
}
"""name -> () -> (model_fn, step_fn)."""


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)
