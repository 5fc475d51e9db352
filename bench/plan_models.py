"""Models for ``python -m bench --plan --model <name>``: the planner on models it was not built on.

Every model takes its shape from the bench ``Workload`` (``--dim``, ``--layers``, ``--seq``,
``--batch``, ``--vocab``) and has random weights (Hugging Face ones are built from a config: no
download). Each comes with its training step (forward and loss; the caller runs backward):

* ``toy``: the shared toy Llama (``bench/model.py``), float32 cross-entropy on its logits.
* ``encoder``: ``nn.TransformerEncoder`` (post-norm, batch first, no dropout) on random features
  (its input needs no grad), mean squared error against a random target.
* ``hf_llama``: ``transformers.LlamaForCausalLM`` (grouped-query attention, 2 KV heads).
* ``hf_gpt2``: ``transformers.GPT2LMHeadModel`` (dropout on, as in training).

Hugging Face models train with ``config.use_cache=False`` (a KV cache is inference state; HF's own
gradient checkpointing turns it off too), so every arm measures the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bench.workloads import Workload

__all__ = ["PLAN_MODELS", "PlanTarget", "build_target"]

PLAN_MODELS = ("toy", "encoder", "hf_llama", "hf_gpt2")
"""Names ``--model`` accepts."""


@dataclass
class PlanTarget:
    """One model, its step and where it runs."""

    name: str
    model: nn.Module
    step: Callable[[], torch.Tensor]
    """One forward and the loss (a scalar that requires grad)."""
    device: torch.device
    engine_device: str | None
    """``"cpu"`` on a CPU-only machine (the engine's real pack -> pool -> unpack path); None on a GPU."""
    run_id: str

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"


def build_target(name: str, workload: Workload, device: torch.device, seed: int = 0) -> PlanTarget:
    """The model ``name`` shaped by ``workload`` on ``device``, with gradients allocated (as in a loop)."""
    if name not in PLAN_MODELS:
        raise ValueError(f"bench: --model {name!r} is not one of {', '.join(PLAN_MODELS)}")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    b, s, d, v = workload.batch, workload.seq_len, workload.dim, workload.vocab_size
    with torch.device(device):  # the model built on the device; inputs drawn on the CPU (g is a CPU generator)
        if name == "toy":
            from bench.harness import build_model
            from bench.model import make_batch

            model = build_model(workload, device, seed)
            tokens, targets = make_batch(model.cfg, b, s, device=device, seed=seed)

            def step() -> torch.Tensor:
                logits = model(tokens)  # (B, T, V)
                return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        elif name == "encoder":
            layer = nn.TransformerEncoderLayer(d, workload.n_heads, 4 * d, dropout=0.0, batch_first=True)
            model = nn.TransformerEncoder(layer, workload.n_layers, enable_nested_tensor=False)
            x = torch.randn(b, s, d, generator=g, device="cpu").to(device)  # (B, T, C)
            y = torch.randn(b, s, d, generator=g, device="cpu").to(device)

            def step() -> torch.Tensor:
                return F.mse_loss(model(x), y)
        else:
            import transformers

            if name == "hf_llama":
                cfg = transformers.LlamaConfig(
                    num_hidden_layers=workload.n_layers, hidden_size=d, intermediate_size=workload.model_config().hidden_ffn,
                    num_attention_heads=workload.n_heads, num_key_value_heads=max(1, workload.n_heads // 2),
                    vocab_size=v, max_position_embeddings=max(s, 64))
                model = transformers.LlamaForCausalLM(cfg)
            else:
                cfg = transformers.GPT2Config(n_layer=workload.n_layers, n_embd=d, n_head=workload.n_heads,
                                              vocab_size=v, n_positions=max(s, 64), bos_token_id=0, eos_token_id=0)
                model = transformers.GPT2LMHeadModel(cfg)
            model.config.use_cache = False
            model.train()
            ids = torch.randint(0, v, (b, s), generator=g, device="cpu").to(device)

            def step() -> torch.Tensor:
                return model(input_ids=ids, labels=ids, use_cache=False).loss
    model.to(workload.torch_dtype)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    run_id = workload.run_id if name == "toy" else f"{name}_{workload.run_id.split('_', 1)[1]}"
    return PlanTarget(name, model, step, device, "cpu" if device.type == "cpu" else None, run_id)
