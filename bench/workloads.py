"""Bench workloads: shapes of the shared toy Llama (``bench/model.py``).

``tiny`` is the CPU default (the whole default run takes about a minute on two
cores). The GPU presets follow Llama 3.2 1B / 3.2 3B / 3.1 8B widths (without
grouped-query attention, which the toy model does not have); ``8b`` stacks as
many h=4096 blocks as fit on the device, up to 32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from bench.model import ToyLlamaConfig

__all__ = ["Workload", "PRESETS", "resolve_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; also accepts ``bf16``/``fp16``/``fp32``."""
    alias = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}
    key = alias.get(name, name)
    if key not in _DTYPES:
        raise ValueError(
            f"bench: dtype={name!r} is not supported; use one of {sorted(_DTYPES)} (or bf16/fp16/fp32)"
        )
    return _DTYPES[key]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One model shape plus batch geometry."""

    name: str
    """Preset name, e.g. ``"tiny"`` or ``"8b"``."""
    dim: int
    """Hidden size h."""
    n_layers: int
    """Transformer blocks (for ``fit_layers`` presets: the upper bound)."""
    n_heads: int
    """Attention heads (head_dim = dim // n_heads)."""
    vocab_size: int
    """Vocabulary size of the embedding and the output head."""
    seq_len: int
    """Tokens per sequence s."""
    batch: int
    """Sequences per step b."""
    dtype: str
    """Parameter and activation dtype name (``float32`` on CPU, ``bfloat16`` on GPU)."""
    fit_layers: bool = False
    """Reduce ``n_layers`` to what fits on the device (measured, see ``harness.fit_layers``)."""

    def __post_init__(self) -> None:
        for field in ("dim", "n_layers", "n_heads", "vocab_size", "seq_len", "batch"):
            value = getattr(self, field)
            if value < 1:
                raise ValueError(f"Workload: {field}={value} must be >= 1")
        resolve_dtype(self.dtype)
        self.model_config()  # validates dim / n_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    @property
    def run_id(self) -> str:
        """File stem for this workload's results, e.g. ``8b_L32_s4096_b1_bfloat16``."""
        return f"{self.name}_L{self.n_layers}_s{self.seq_len}_b{self.batch}_{self.dtype}"

    def model_config(self, n_layers: int | None = None) -> ToyLlamaConfig:
        return ToyLlamaConfig(
            vocab_size=self.vocab_size,
            dim=self.dim,
            n_layers=self.n_layers if n_layers is None else n_layers,
            n_heads=self.n_heads,
            max_seq_len=self.seq_len,
        )

    def params_per_layer(self) -> int:
        cfg = self.model_config()
        return 4 * self.dim * self.dim + 3 * self.dim * cfg.hidden_ffn + 2 * self.dim

    def param_count(self) -> int:
        return self.n_layers * self.params_per_layer() + 2 * self.vocab_size * self.dim + self.dim

    def flops_per_step(self) -> float:
        """Training FLOPs per step (forward + backward, no recompute): 6*N*tokens plus causal attention.

        Attention scores and values are 2 matmuls of 2*s*s*h FLOPs per layer forward, halved by the
        causal mask, times 3 for forward + backward.
        """
        tokens = self.tokens_per_step
        dense = 6.0 * (self.n_layers * self.params_per_layer() + self.vocab_size * self.dim) * tokens
        attn = 3.0 * self.n_layers * self.batch * 2 * (2.0 * self.seq_len * self.seq_len * self.dim) / 2
        return dense + attn

    def replace(self, **changes: object) -> "Workload":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, Workload] = {
    "tiny": Workload(
        name="tiny", dim=256, n_layers=4, n_heads=4, vocab_size=1024, seq_len=256, batch=2, dtype="float32"
    ),
    "1b": Workload(
        name="1b", dim=2048, n_layers=16, n_heads=16, vocab_size=32000, seq_len=4096, batch=1, dtype="bfloat16"
    ),
    "3b": Workload(
        name="3b", dim=3072, n_layers=28, n_heads=24, vocab_size=32000, seq_len=4096, batch=1, dtype="bfloat16"
    ),
    "8b": Workload(
        name="8b",
        dim=4096,
        n_layers=32,
        n_heads=32,
        vocab_size=32000,
        seq_len=4096,
        batch=1,
        dtype="bfloat16",
        fit_layers=True,
    ),
}
