"""The one toy Llama-like model shared by tests, bench and examples.

RMSNorm -> attention with RoPE and SDPA -> RMSNorm -> SwiGLU MLP, pre-norm
residual blocks, and an output head that is either its own Linear or tied to
the token embedding. Small enough for CPU unit tests, shaped like the real
thing at the GPU presets in ``bench/workloads.py``.

    >>> cfg = ToyLlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4)
    >>> model = ToyLlama(cfg)
    >>> logits = model(torch.randint(0, 256, (2, 16)))   # (B, T, vocab)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ToyLlamaConfig", "ToyLlama", "Block", "RMSNorm", "make_batch"]


@dataclass(frozen=True, kw_only=True)
class ToyLlamaConfig:
    vocab_size: int = 256
    """Vocabulary size (tokens)."""
    dim: int = 64
    """Hidden size h."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads; head_dim = dim // n_heads."""
    ffn_dim: int | None = None
    """SwiGLU hidden size; default is Llama's 8/3 * dim rounded up to 32."""
    max_seq_len: int = 512
    """Longest sequence the RoPE tables cover."""
    tie_embeddings: bool = False
    """Share the output head's weight with the token embedding."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(
                f"ToyLlamaConfig: dim={self.dim} must be divisible by n_heads={self.n_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"ToyLlamaConfig: head_dim={self.dim // self.n_heads} must be even for RoPE"
            )

    @property
    def hidden_ffn(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 32 * math.ceil(8 * self.dim / 3 / 32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as Llama does, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def _rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)  # (T, hd/2)
    return freqs.cos(), freqs.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); rotate interleaved-free halves.
    x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, hd/2) each
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ToyLlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.wqkv(x)  # (B, T, 3C)
        q, k, v = qkv.split(C, dim=-1)  # views of one storage: (B, T, C) each
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        q = _apply_rope(q, cos[:T], sin[:T])
        k = _apply_rope(k, cos[:T], sin[:T])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.wo(y)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ToyLlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_ffn, bias=False)
        self.w2 = nn.Linear(cfg.hidden_ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ToyLlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class ToyLlama(nn.Module):
    """Llama-shaped decoder: ``tok_embeddings -> layers -> norm -> output``."""

    def __init__(self, cfg: ToyLlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = _rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.checkpoint_blocks = False
        """When True, each block runs under non-reentrant activation checkpointing."""
        self.checkpoint_context_fn = None
        """Optional ``context_fn`` for those checkpoints (e.g. a selective-checkpoint policy)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden_states(tokens))  # (B, T, vocab)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The output head's input: the final norm of the last block's output (a tiled loss starts here)."""
        h = self.tok_embeddings(tokens)  # (B, T, C)
        for layer in self.layers:
            if self.checkpoint_blocks:
                kw = {"context_fn": self.checkpoint_context_fn} if self.checkpoint_context_fn else {}
                h = torch.utils.checkpoint.checkpoint(
                    layer, h, self.rope_cos, self.rope_sin, use_reentrant=False, **kw
                )
            else:
                h = layer(h, self.rope_cos, self.rope_sin)
        return self.norm(h)  # (B, T, C)


def make_batch(
    cfg: ToyLlamaConfig, batch: int, seq: int, *, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (tokens, targets) for a next-token loss, drawn on the CPU (the same on every device, and
    inside a ``torch.device`` context too: a CPU generator cannot draw on another device) and moved."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g, device="cpu")
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
