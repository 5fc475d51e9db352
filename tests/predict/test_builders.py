"""model_fn as users write it: peft's get_peft_model, a cast (.to(torch.bfloat16)), a move to the GPU (.cuda(),
.to("cuda"), torch.device("cuda")), a model built before the call or on the meta device, torchao NF4 base
weights (QLoRA), and bitsandbytes layers refused by name (issue 45 item 2)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload.predict import PredictError, predict_step

from predict_testkit import CASES, V, adamw, hf, toy

BF16 = torch.bfloat16


def _peft(kind: str, r: int = 4):
    peft = pytest.importorskip("peft")
    model_fn, step_fn = hf(kind)
    targets = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
               "gpt2": ["c_attn", "c_proj", "c_fc"]}[kind]

    def build() -> nn.Module:
        base = model_fn().to(BF16)
        return peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                                         target_modules=targets))

    return build, step_fn


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_peft_lora_predicts_with_optimizer_state_for_the_adapters_only(kind):
    """A peft LoRA model (bf16 base cast with .to() in model_fn) predicts; AdamW's state is two fp32 copies of the
    adapters (far below the base), the gradients are the adapters', and the base parameters are bf16."""
    pytest.importorskip("transformers")
    build, step_fn = _peft(kind)
    p = predict_step(build, step_fn, gpu="h100-sxm", strategy="offload", optimizer=adamw)
    real = build()
    adapters = sum(t.numel() * t.element_size() for t in real.parameters() if t.requires_grad)
    frozen = sum(t.numel() for t in real.parameters() if not t.requires_grad)
    assert adapters and p.state_bytes["gradient"] == adapters
    assert p.state_bytes["optimizer"] == pytest.approx(2 * adapters, rel=0.01)
    assert p.state_bytes["parameter"] == adapters + 2 * frozen  # the frozen base in bf16
    assert p.offloaded_bytes > 0


@pytest.mark.parametrize("name", ["toy_llama", "hf_llama"])
def test_a_cast_in_model_fn_is_the_cast_model(name):
    """model_fn returning model.to(torch.bfloat16) predicts what dtype=torch.bfloat16 predicts."""
    model_fn, step_fn = CASES[name]()
    cast = predict_step(lambda: model_fn().to(BF16), step_fn, gpu="h100-sxm", strategy="none", optimizer=adamw)
    given = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", optimizer=adamw, dtype=BF16)
    assert cast.state_bytes == given.state_bytes and cast.peak_bytes == given.peak_bytes


def _builds_and_steps(name: str, how: str):
    """(model_fn, step_fn) of CASES[name] as written for a GPU: the model moved by ``how``, the inputs moved."""
    model_fn, step_fn = CASES[name]()

    def build() -> nn.Module:
        if how == "device":
            with torch.device("cuda"):
                return model_fn()
        return model_fn().cuda() if how == "cuda" else model_fn().to("cuda")

    def step(model: nn.Module) -> torch.Tensor:
        tokens = torch.randint(0, V, (2, 16)).to("cuda")
        if name == "hf_llama":
            return model(input_ids=tokens, labels=tokens).loss
        return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

    return build, step


@pytest.mark.parametrize("how", ["cuda", "to", "device"])
@pytest.mark.parametrize("name", ["toy_llama", "hf_llama"])
def test_moving_to_the_gpu_in_model_fn_and_step_fn_predicts_the_same_step(name, how):
    """.cuda(), .to("cuda") and torch.device("cuda") in model_fn, and inputs moved with .to("cuda") in step_fn,
    predict the step that model_fn and step_fn without the moves predict (the GPU is the prediction's)."""
    model_fn, step_fn = CASES[name]()
    plain = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="offload", optimizer=adamw)
    moved = predict_step(*_builds_and_steps(name, how), gpu="h100-sxm", strategy="offload", optimizer=adamw)
    assert moved.peak_bytes == plain.peak_bytes and moved.offloaded_bytes == plain.offloaded_bytes


@pytest.mark.parametrize("where", ["built", "meta"])
def test_a_model_built_before_the_call_or_on_meta_is_predicted(where):
    """lambda: model (a real model built before the call) and a model built on the meta device predict what
    model_fn predicts; the real model's parameters are left untouched."""
    model_fn, step_fn = toy()
    if where == "built":
        model = model_fn()
        before = {n: t.clone() for n, t in model.state_dict().items()}
    else:
        with torch.device("meta"):
            model = model_fn()
    p = predict_step(lambda: model, step_fn, gpu="h100-sxm", strategy="offload", optimizer=adamw)
    ref = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="offload", optimizer=adamw)
    assert p.peak_bytes == ref.peak_bytes and p.offloaded_bytes == ref.offloaded_bytes
    if where == "built":
        assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
        assert all(p.grad is None for p in model.parameters())


class _QLoRA(nn.Module):
    """A linear layer with a frozen NF4 base weight and a LoRA adapter, as torchtune's QLoRA builders make it."""

    def __init__(self, dim: int = 512, r: int = 8) -> None:
        super().__init__()
        from torchao.quantization import to_nf4

        base = nn.Linear(dim, dim, bias=False, dtype=BF16)
        self.weight = nn.Parameter(to_nf4(base.weight.detach()), requires_grad=False)
        self.lora_a = nn.Linear(dim, r, bias=False)
        self.lora_b = nn.Linear(r, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.lora_b(self.lora_a(x.float())).to(x.dtype)


def test_nf4_base_weights_are_counted_at_their_stored_size():
    """torchao NF4 base weights count as their packed 4-bit data and scalers (about a quarter of bf16), not as a
    bf16 tensor of their shape."""
    pytest.importorskip("torchao.quantization", reason="torchao with NF4 (torchao.quantization.to_nf4) is not installed")
    dim, r = 512, 8
    p = predict_step(_QLoRA, lambda m: m(torch.randn(4, dim, dtype=BF16)).float().sum(), gpu="h100-sxm",
                     strategy="none")
    adapters = 2 * dim * r * 4
    base = p.state_bytes["parameter"] - adapters
    assert dim * dim // 2 <= base <= 0.3 * dim * dim * 2, base  # 4 bits a weight plus scalers, < 0.3x bf16


def test_bitsandbytes_layers_are_refused_by_name(monkeypatch):
    """A bitsandbytes layer (it quantizes when moved to the GPU, which a prediction never does) is refused by its
    name, saying what would have been counted and what to use instead."""
    mod = types.ModuleType("bitsandbytes.nn.modules")
    Linear4bit = type("Linear4bit", (nn.Linear,), {"__module__": "bitsandbytes.nn.modules"})
    mod.Linear4bit = Linear4bit
    monkeypatch.setitem(sys.modules, "bitsandbytes.nn.modules", mod)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = Linear4bit(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x)

    with pytest.raises(PredictError, match=r"q is a bitsandbytes Linear4bit.*unquantized size.*NF4"):
        predict_step(Model, lambda m: m(torch.randn(2, 64)).sum(), gpu="h100-sxm", strategy="none")
