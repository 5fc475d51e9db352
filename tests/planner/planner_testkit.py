"""Helpers shared by the planner tests: the tiny toy Llama and its step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.model import ToyLlama, ToyLlamaConfig, make_batch

CFG = ToyLlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=128)


def make_model_and_step(seed: int = 0):
    """A 4-block toy Llama (h=64) and a zero-argument step returning its loss (batch 2, seq 64)."""
    torch.manual_seed(seed)
    model = ToyLlama(CFG)
    tokens, targets = make_batch(CFG, 2, 64)

    def step() -> torch.Tensor:
        logits = model(tokens)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return model, step


# -- models the planner was not built on (issue 24) -------------------------------------------


def make_encoder_and_step(layers: int = 4, d: int = 64, batch: int = 4, seq: int = 64, seed: int = 0):
    """An ``nn.TransformerEncoder`` (post-norm, input without grad) and a step returning its loss."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    x = torch.randn(batch, seq, d)  # (B, T, C)

    def step() -> torch.Tensor:
        return model(x).square().mean()

    return model, step


class _Res(torch.nn.Module):
    def __init__(self, d: int, mult: int = 4) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, mult * d)
        self.down = torch.nn.Linear(mult * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class WideStem(torch.nn.Module):
    """A big temporary before the first block (a wide projection reduced to the model width)."""

    def __init__(self, d: int = 32, wide: int = 1024, n: int = 10) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(d, wide)
        self.layers = torch.nn.ModuleList(_Res(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.stem(x).view(*x.shape[:-1], -1, x.shape[-1]).mean(-2)  # (B, T, wide) -> (B, T, C)
        for layer in self.layers:
            x = layer(x)
        return x


class SharedBlock(torch.nn.Module):
    """Weight sharing: ``layers.1`` runs twice per step."""

    def __init__(self, d: int = 64, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Res(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.layers[1](x)


class BNBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.bn = torch.nn.BatchNorm1d(d)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C)
        return x + self.drop(torch.relu(self.bn(self.lin(x))))


class BNNet(torch.nn.Module):
    """Blocks with BatchNorm (running stats mutate in forward) and dropout (uses the RNG)."""

    def __init__(self, d: int = 64, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(BNBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Staged(torch.nn.Module):
    """A staged model: a list of lists of blocks."""

    def __init__(self, d: int = 32, stages: int = 2, per: int = 2) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(torch.nn.ModuleList(_Res(d) for _ in range(per)) for _ in range(stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return x


def step_for(model: torch.nn.Module, x: torch.Tensor):
    def step() -> torch.Tensor:
        return model(x).square().mean()

    return step


def hf_causal_lm(kind: str, seed: int = 0, layers: int = 3, batch: int = 2, seq: int = 32):
    """A tiny Hugging Face causal LM built from its config (random weights, no download) and its step."""
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=256,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                       max_position_embeddings=256)
        model = transformers.LlamaForCausalLM(cfg)
    model.train()
    ids = torch.randint(0, 128, (batch, seq))

    def step() -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    return model, step


class _TableBlock(torch.nn.Module):
    """A block fed the model's shared table besides its input (rotary cos/sin), returning its attention-like
    weights too (as Megatron-BERT's layers do): the model drops them."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, table: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.table if table is None else table
        weights = torch.softmax(x @ x.transpose(-1, -2), dim=-1)  # (B, T, T)
        out = x + (weights @ self.fc(x)) * table
        if bias is not None:  # an add saves neither side: only a checkpoint holds it (position ids)
            out = out + bias
        return out, weights


class SharedTable(torch.nn.Module):
    """Blocks that all save one tensor the model makes once (a rotary table), and return a second tensor
    the model's loop variable holds until the next block returns (found on transformers models: a measured
    plan overshot its budget by the table, and by a layer's attention weights).

    ``mode``: how the blocks get the table: "positional" (an argument), "keyword" (``table=``, with a
    ``bias=`` no block saves but a checkpoint holds, as Llama's position ids: a checkpoint holds keyword
    arguments in its closure, where no saved-tensor hook sees them) or "attribute" (set on each block, no
    argument: kept there until the next step, as a model's cache, so a recompute finds it). The stem's
    output stays in a local through every block's forward, as an embedding's does."""

    def __init__(self, d: int = 32, n: int = 3, mode: str = "positional") -> None:
        super().__init__()
        self.stem = torch.nn.Linear(d, d)
        self.layers = torch.nn.ModuleList(_TableBlock(d) for _ in range(n))
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.cos(torch.arange(x.shape[1] * x.shape[2], dtype=x.dtype).view(x.shape[1], x.shape[2]))
        bias = torch.sin(table)
        embeds = x = self.stem(x)  # a local until forward returns (Hugging Face's inputs_embeds)
        for layer in self.layers:
            if self.mode == "positional":
                out = layer(x, table)
            elif self.mode == "keyword":
                out = layer(x, table=table, bias=bias)
            else:
                layer.table = table
                out = layer(x)
            x = out[0]
        del embeds
        return x
