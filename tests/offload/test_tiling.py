"""Tiled MLP and tiled loss (offload.tiling, NOTE [ Tiles ]): the untiled step's numbers, less memory.

Every model test follows the twin pattern: a model and its ``copy.deepcopy`` run the same step, one
tiled and one not. Where the tiles leave the reduction order alone (the MLP's output and input gradient:
per-token math) the comparison is ``torch.equal``; where they reorder a sum over tokens (parameter
gradients, the loss) it is within float rounding, stated per test.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload import OffloadActivations, OffloadError, linear_cross_entropy, tile_loss, tile_mlp
from offload._tiled_loss import select_loss_impl
from offload.planner.meter import measure_step

transformers = pytest.importorskip("transformers")

FP32_RTOL = 1e-5
"""Largest |difference| / max |reference| of an fp32 gradient whose sum over tokens the tiles reorder."""

ARCHS = {
    "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                              max_position_embeddings=512),
    "qwen2": lambda: transformers.Qwen2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=176,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                              max_position_embeddings=512, use_sliding_window=False),
    # Falcon's blocks add the attention output into the MLP's output in place
    "falcon": lambda: transformers.FalconConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                vocab_size=300, max_position_embeddings=512),
    "mistral": lambda: transformers.MistralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                                  max_position_embeddings=512, sliding_window=None),
}


def hf_model(arch: str = "llama") -> nn.Module:
    cfg = ARCHS[arch]()
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    model = getattr(transformers, {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                   "mistral": "MistralForCausalLM", "falcon": "FalconForCausalLM"}[arch])(cfg)
    return model.train()


def labels_step(model: nn.Module, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def labels_peak(model: nn.Module, ids: torch.Tensor) -> int:
    """Peak memory of one labels= step, measured on CPU with MemTracker (offload.planner.meter)."""
    return measure_step(lambda: model(input_ids=ids, labels=ids).loss.backward(), device="cpu", model=model,
                        warmup=0, timed=0).peak_bytes


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def assert_close_grads(got: dict, ref: dict, rtol: float) -> None:
    assert got.keys() == ref.keys()
    worst = max(ref, key=lambda n: rel_diff(got[n], ref[n]))
    assert rel_diff(got[worst], ref[worst]) <= rtol, (worst, rel_diff(got[worst], ref[worst]))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiled_step_matches_untiled_on_hf_architectures(arch):
    """Tiled MLP + tiled labels= loss: the loss and every gradient equal the untiled twin's within fp32 rounding."""
    model = hf_model(arch)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 300, (2, 200))
    ref_loss, ref = labels_step(twin, ids)
    mlp, loss = tile_mlp(model, tokens=48), tile_loss(model, tokens=64)
    got_loss, got = labels_step(model, ids)
    assert mlp.stats()["calls"] == 2 and mlp.stats()["tiles"] == 2 * 9  # 400 tokens in tiles of 48
    assert loss.stats() == {"calls": 1, "tiles": 7, "bytes_not_saved": 400 * 300 * 4 - 400 * 4, "impl": "builtin"}
    assert rel_diff(got_loss, ref_loss) <= FP32_RTOL
    assert_close_grads(got, ref, FP32_RTOL)


def test_remove_restores_the_model_bitwise():
    """After remove() the model computes exactly what it computed before tiling (no state left behind)."""
    model = hf_model()
    ids = torch.randint(0, 300, (1, 160))
    before = labels_step(model, ids)
    handles = [tile_mlp(model, tokens=32), tile_loss(model, tokens=32)]
    labels_step(model, ids)
    for h in handles:
        h.remove()
    after = labels_step(model, ids)
    assert torch.equal(before[0], after[0]) and all(torch.equal(before[1][n], after[1][n]) for n in before[1])
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_output_and_input_grad_are_bitwise(dtype):
    """Per-token math: the tiled MLP's output and input gradient are bitwise the untiled one's; its weight
    gradients (a sum over tokens, reordered) agree within one rounding of the dtype."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(ARCHS["llama"]()).to(dtype)
    twin = copy.deepcopy(mlp)
    x = torch.randn(2, 300, 64, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(2, 300, 64, dtype=dtype)
    y = twin(x)
    y.backward(g)
    tile_mlp(nn.Module(), modules=[mlp], tokens=64)
    y2 = mlp(x2)
    y2.backward(g)
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    rtol = FP32_RTOL if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    for (n, p), (_, q) in zip(twin.named_parameters(), mlp.named_parameters()):
        assert q.grad.dtype == p.grad.dtype and rel_diff(q.grad, p.grad) <= rtol, n


def _saved_activation_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes the untiled module saves for backward that are not its input or a parameter."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in skip and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).sum().backward()
    return total


def test_mlp_bytes_not_saved_are_what_the_untiled_module_saves():
    """The ledger's and the handle's MLP bytes_not_saved equal the activations the untiled twin saves."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(ARCHS["llama"]())
    x = torch.randn(1, 256, 64, requires_grad=True)
    expected = _saved_activation_bytes(copy.deepcopy(mlp), x.detach().requires_grad_())
    assert expected >= 4 * 256 * 176 * 4  # gate, act, up, product: the test measures something real
    engine = OffloadActivations(device="cpu")
    handle = tile_mlp(nn.Module(), modules=[mlp], tokens=64, engine=engine)
    mlp(x).sum().backward()
    engine.close_step()
    assert handle.stats() == {"calls": 1, "tiles": 4, "bytes_not_saved": expected}
    assert engine.ledger.summary()["tiling"]["mlp"] == handle.stats()


def test_tiled_mlp_lowers_the_measured_peak():
    """MemTracker (offload.planner.meter) on CPU: the tiled model's step peaks lower than its untiled twin's
    by at least half of the bytes the tiles report not saving (the rest is the one tile alive)."""
    model = hf_model()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 300, (1, 512))
    untiled = labels_peak(twin, ids)
    handle = tile_mlp(model, tokens=64)
    tiled = labels_peak(model, ids)
    spared = handle.stats()["bytes_not_saved"]
    assert spared > 0 and untiled - tiled >= spared // 2, (untiled, tiled, spared)


def test_tiled_loss_lowers_the_measured_peak():
    """MemTracker on CPU: a large-vocabulary labels= loss in tiles peaks lower than the full logits by at
    least the float32 log-probabilities it does not save."""
    cfg = ARCHS["llama"]()
    cfg.vocab_size, cfg.num_hidden_layers = 8192, 1
    model = transformers.LlamaForCausalLM(cfg).train()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 8192, (1, 256))
    untiled = labels_peak(twin, ids)
    tile_loss(model, tokens=32)
    assert untiled - labels_peak(model, ids) >= 256 * 8192 * 4


def test_linear_cross_entropy_matches_cross_entropy():
    """linear_cross_entropy == F.cross_entropy(head(h).float(), y) with ignored labels, mean and sum, and its
    hidden, weight and bias gradients agree within fp32 rounding."""
    head = nn.Linear(32, 100)
    h = torch.randn(3, 50, 32, requires_grad=True)
    y = torch.randint(0, 100, (3, 50))
    y[:, ::7] = -100
    for reduction in ("mean", "sum"):
        twin = copy.deepcopy(head)
        h2 = h.detach().clone().requires_grad_()
        ref = F.cross_entropy(twin(h).float().flatten(0, 1), y.flatten(), reduction=reduction)
        ref.backward()
        got = linear_cross_entropy(h2, head, y, reduction=reduction, tokens=16)
        got.backward()
        assert rel_diff(got, ref) <= FP32_RTOL
        for a, b in ((h2.grad, h.grad), (head.weight.grad, twin.weight.grad), (head.bias.grad, twin.bias.grad)):
            assert rel_diff(a, b) <= FP32_RTOL
        h.grad = head.weight.grad = head.bias.grad = None


def test_labels_path_with_num_items_in_batch():
    """HF's num_items_in_batch (a Trainer's gradient accumulation) divides the summed loss, as ForCausalLMLoss."""
    model = hf_model()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 300, (2, 100))
    n = torch.tensor(123)
    ref_loss, ref = labels_step(twin, ids, num_items_in_batch=n)
    tile_loss(model, tokens=40)
    got_loss, got = labels_step(model, ids, num_items_in_batch=n)
    assert rel_diff(got_loss, ref_loss) <= FP32_RTOL
    assert_close_grads(got, ref, FP32_RTOL)


def test_labels_path_returns_no_logits_and_leaves_inference_alone():
    """A training call with labels returns logits=None; a call without labels, or without grad, returns
    the untiled logits bitwise."""
    model = hf_model()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 300, (1, 64))
    tile_loss(model, tokens=16)
    assert model(input_ids=ids, labels=ids).logits is None
    assert torch.equal(model(input_ids=ids).logits, twin(input_ids=ids).logits)
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
        assert torch.equal(out.logits, twin(input_ids=ids, labels=ids).logits)


def test_autocast_bf16_matches_untiled_within_bf16_rounding():
    """Under CPU autocast (bf16 compute, fp32 weights) the tiled step's loss and gradients are the untiled
    step's within bf16 rounding, in the parameters' dtype."""
    model = hf_model()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 300, (1, 256))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref = labels_step(twin, ids)
    tile_mlp(model, tokens=64)
    tile_loss(model, tokens=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_loss, got = labels_step(model, ids)
    assert all(got[n].dtype == torch.float32 for n in got)
    assert rel_diff(got_loss, ref_loss) <= 1e-2
    assert_close_grads(got, ref, 5e-2)


def test_recompute_replays_the_forward_dropout_masks():
    """A module with dropout: backward's recompute draws the forward's masks (RNG state restored), so the
    input gradient is the gradient of what forward computed."""
    drop = nn.Dropout(0.5)
    x = torch.randn(1, 400, 16, requires_grad=True)
    tile_mlp(nn.Module(), modules=[drop], tokens=64)
    y = drop(x)
    g = torch.randn_like(y)
    y.backward(g)
    kept = (y != 0).float()
    assert 0.3 < kept.mean() < 0.7
    assert torch.allclose(x.grad, g * kept * 2.0)


def test_parameter_gradients_reach_autograd_grad_once():
    """torch.autograd.grad(loss, params) works through the tiles and leaves .grad alone; a parameter's
    gradient hook fires once per backward (DDP's and FSDP's hooks assume so)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(ARCHS["llama"]())
    fired = []
    mlp.up_proj.weight.register_hook(lambda g: fired.append(1))
    tile_mlp(nn.Module(), modules=[mlp], tokens=32)
    loss = mlp(torch.randn(1, 200, 64, requires_grad=True)).square().sum()
    grads = torch.autograd.grad(loss, list(mlp.parameters()))
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for p in mlp.parameters()) and fired == [1]


def test_ledger_names_both_kinds_when_nothing_is_tiled():
    """summary()["tiling"] always has the mlp and loss rows (zero without tiles)."""
    engine = OffloadActivations(device="cpu")
    with engine:
        x = torch.randn(4, 4, requires_grad=True)
        y = (x * x).sum()
    y.backward()
    assert engine.ledger.summary()["tiling"] == {k: {"calls": 0, "tiles": 0, "bytes_not_saved": 0}
                                                 for k in ("mlp", "loss")}


# -- choosing the loss implementation ---------------------------------------------------------------


def test_auto_picks_a_fused_kernel_on_cuda_only(fake_libraries):
    """impl="auto": Liger first, then cut-cross-entropy, on CUDA tensors; the built-in tiles on CPU."""
    _, monkeypatch = fake_libraries
    assert select_loss_impl("auto", "cuda")[0] == "liger"
    assert select_loss_impl("auto", "cpu") == ("builtin", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", None)  # not importable
    assert select_loss_impl("auto", "cuda")[0] == "cut_cross_entropy"
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)
    assert select_loss_impl("auto", "cuda") == ("builtin", None)


def test_missing_library_is_refused_when_tiling_not_at_the_first_step():
    """impl="liger" without Liger installed raises ImportError naming it at tile_loss time."""
    if select_loss_impl("auto", "cuda")[0] == "liger":
        pytest.skip("Liger-Kernel is installed here")
    with pytest.raises(ImportError, match="liger_kernel"):
        tile_loss(hf_model(), impl="liger")


def test_the_chosen_library_runs_and_is_reported(fake_libraries):
    """A named library computes the loss (its function is called) and the handle says which ran."""
    calls, _ = fake_libraries
    model = hf_model()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 300, (1, 64))
    ref_loss, _ = labels_step(twin, ids)
    handle = tile_loss(model, impl="cut_cross_entropy")
    got_loss, _ = labels_step(model, ids)
    assert calls == {"liger": 0, "cut_cross_entropy": 1}
    assert handle.stats()["impl"] == "cut_cross_entropy" and handle.stats()["calls"] == 1
    assert rel_diff(got_loss, ref_loss) <= FP32_RTOL


# -- what is refused, and how ------------------------------------------------------------------------


def test_bad_inputs_are_refused_with_the_fix():
    """Non-HF model for tile_loss, modules that are not per-token (a result or an argument without the tokens
    first), zero tokens, tiling twice: each raises an error that names the problem and the way out (a logit map the tiles cannot replay: test_tiled_logit_maps)."""
    with pytest.raises(OffloadError, match="linear_cross_entropy"):
        tile_loss(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="tokens=0"):
        tile_mlp(hf_model(), tokens=0)
    model = hf_model()
    tile_mlp(model)
    with pytest.raises(OffloadError, match="already tiled"):
        tile_mlp(model)

    class Pooled(nn.Module):  # a second result that sums over the tokens: not per-token
        def forward(self, x):
            return x * 2, x.sum(1)

    m = Pooled()
    tile_mlp(nn.Module(), modules=[m], tokens=8)  # x.sum(1) is (1, 8) for a tile of 8 tokens of 8 features
    with pytest.raises(OffloadError, match=r"Pooled returned a tensor of shape \(1, 8\).*per-token"):
        m(torch.randn(1, 32, 8, requires_grad=True))

    class Masked(nn.Module):  # a tensor argument without the tokens first
        def forward(self, x, mask):
            return x * mask.sum()

    m = Masked()
    tile_mlp(nn.Module(), modules=[m], tokens=4)
    with pytest.raises(OffloadError, match=r"Masked was called with a tensor of shape \(1, 1, 16, 16\) as its "
                                           r"argument 2.*tiled_mlp=False"):
        m(torch.randn(1, 16, 8), torch.ones(1, 1, 16, 16))
    with pytest.raises(OffloadError, match="feed-forward submodule|nn.ModuleList"):
        tile_mlp(nn.Sequential(nn.Linear(4, 4)))


def test_public_names():
    """The tiling entry points are public in offload's __init__."""
    for name in ("tile_mlp", "tile_loss", "linear_cross_entropy", "TilingHandle", "long_context",
                 "LongContextHandle"):
        assert name in offload.__all__ and hasattr(offload, name)


# -- what runs untiled, and why ------------------------------------------------------------------------


def _moe(**kw) -> nn.Module:
    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=300, num_local_experts=4, num_experts_per_tok=2,
                                     router_aux_loss_coef=0.5, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).train()


def test_a_mixture_of_experts_whose_router_logits_are_recorded_runs_untiled():
    """output_router_logits=True: transformers records each router's logits through forward hooks for the
    auxiliary loss. In tiles the hooks would get detached pieces and the routers no gradient from that loss
    (a relative error of ~1 in every router weight's gradient, silently); the calls run untiled instead,
    bitwise as the untiled model, with one warning naming the router, and handle.untiled counting them. Once the
    model stops recording (the hooks stay installed), the same modules are tiled again."""
    model = _moe(output_router_logits=True)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 300, (2, 64))
    ref_loss, ref = labels_step(twin, ids)
    handle = tile_mlp(model, tokens=16)
    router = r"MixtralSparseMoeBlock runs untiled while model.layers.0.mlp.gate \(MixtralTopKRouter\)"
    with pytest.warns(UserWarning, match=router) as warned:
        got_loss, got = labels_step(model, ids)
    assert sum("tile_mlp" in str(w.message) for w in warned) == 1  # once a handle, not once a layer
    assert torch.equal(got_loss, ref_loss) and all(torch.equal(got[n], ref[n]) for n in ref)
    assert handle.untiled == {"model.layers.0.mlp.gate (MixtralTopKRouter)": 1,
                              "model.layers.1.mlp.gate (MixtralTopKRouter)": 1} and handle.stats()["calls"] == 0
    assert any(".gate" in n for n in ref) and any(ref[n].abs().sum() > 0 for n in ref if n.endswith("gate.weight"))
    model.config.output_router_logits = twin.config.output_router_logits = False
    ref_loss, ref = labels_step(twin, ids)
    got_loss, got = labels_step(model, ids)
    assert handle.stats()["calls"] == 2 and sum(handle.untiled.values()) == 2
    assert rel_diff(got_loss, ref_loss) <= FP32_RTOL
    assert_close_grads(got, ref, FP32_RTOL)


def test_any_hook_inside_a_tiled_module_makes_its_calls_untiled():
    """A user's forward hook on a submodule of the MLP (activation statistics, a recorder) sees what it sees
    untiled: the call runs as it is while the hook is there, and is tiled again once it is removed."""
    model = hf_model()
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    handle = tile_mlp(model, tokens=16)
    ids = torch.randint(0, 300, (1, 64))
    with pytest.warns(UserWarning, match=r"down_proj \(Linear\)"):
        labels_step(model, ids)
    assert seen == [(1, 64, 64)] and handle.untiled == {"model.layers.0.mlp.down_proj (Linear)": 1} and handle.stats()["calls"] == 1
    hook.remove()
    labels_step(model, ids)
    assert handle.stats()["calls"] == 3 and handle.untiled == {"model.layers.0.mlp.down_proj (Linear)": 1}


def test_a_checkpoints_recompute_runs_the_mlp_as_its_forward_did():
    """long_context checkpoints the blocks: backward recomputes each block's MLP while transformers records
    nothing (its collector is only set during forward). The recompute must run the MoE block untiled as its
    forward did, or the checkpoint sees other tensors saved (CheckpointError); loss and gradients as the
    untiled model's, the router's included."""
    model = _moe(output_router_logits=True)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 300, (2, 64))
    ref_loss, ref = labels_step(twin, ids)
    handle = offload.long_context(model, mlp_tokens=16, loss_tokens=16, device="cpu", min_offload_size=0)
    with pytest.warns(UserWarning, match="runs untiled"), handle.engine:
        got_loss, got = labels_step(model, ids)
    assert handle.checkpointing == "offload" and sum(handle.mlp.untiled.values()) == 2
    assert rel_diff(got_loss, ref_loss) <= FP32_RTOL
    assert_close_grads(got, ref, FP32_RTOL)


def test_a_submodule_whose_forward_records_its_output_makes_the_call_untiled():
    """transformers 4.54-4.57 recorded router logits by replacing the router's forward with a wrapper
    (``make_capture_wrapper.<locals>.wrapped_forward``) for the duration of a recording call: while one
    is in place the MLP runs untiled, and tiled again once it is gone."""
    model = hf_model()
    mlp = model.model.layers[1].mlp
    recorded = []

    def make_capture_wrapper(module, orig_forward):  # the shape of transformers' wrapper
        def wrapped_forward(*args, **kwargs):
            out = orig_forward(*args, **kwargs)
            recorded.append(out)
            return out
        return wrapped_forward

    mlp.up_proj.forward = make_capture_wrapper(mlp.up_proj, mlp.up_proj.forward)
    handle = tile_mlp(model, tokens=16)
    ids = torch.randint(0, 300, (1, 64))
    with pytest.warns(UserWarning, match=r"layers.1.mlp.up_proj \(Linear\)"):
        labels_step(model, ids)
    assert len(recorded) == 1 and recorded[0].shape == (1, 64, 176) and recorded[0].requires_grad
    assert handle.untiled == {"model.layers.1.mlp.up_proj (Linear)": 1} and handle.stats()["calls"] == 1
    del mlp.up_proj.forward
    labels_step(model, ids)
    assert handle.stats()["calls"] == 3


def test_a_module_computing_with_a_parameter_it_does_not_own_is_refused():
    """A per-token module that multiplies by another module's parameter (held as a plain attribute): the
    tiles differentiate the module's own parameters and input only, so that parameter's gradient would be
    None. Backward raises naming the shape instead; a frozen outside tensor, or a parameter of the module
    whose gradient is not asked for, is fine."""

    class Shared(nn.Module):
        def __init__(self, shared: torch.Tensor) -> None:
            super().__init__()
            self.up = nn.Linear(8, 16)
            self.__dict__["shared"] = shared  # not registered

        def forward(self, x):
            return torch.relu(self.up(x)) @ self.shared

    outside = nn.Parameter(torch.randn(16, 8))
    m = Shared(outside)
    tile_mlp(nn.Module(), modules=[m], tokens=8)
    x = torch.randn(1, 64, 8, requires_grad=True)
    with pytest.raises(OffloadError, match=r"1 tensor\(s\) needing a gradient.*\(16, 8\)"):
        m(x).sum().backward()
    outside.requires_grad_(False)
    m(x).sum().backward()
    assert x.grad is not None and m.up.weight.grad is not None
    (gx,) = torch.autograd.grad(m(x).sum(), [x])  # the module's parameters want gradients, none asked for
    assert torch.allclose(gx, x.grad, rtol=1e-5, atol=1e-6)


def test_a_loss_function_set_after_tiling_is_not_replaced():
    """``model.loss_function = custom`` after tile_loss: the next labelled call raises naming it, instead of
    the tiles silently computing plain cross-entropy in its place."""
    model = hf_model()
    tile_loss(model, tokens=16)
    ids = torch.randint(0, 300, (1, 32))
    labels_step(model, ids)

    def smoothed(logits, labels, vocab_size, **kwargs):
        return F.cross_entropy(logits.float().flatten(0, 1)[:-1], labels.flatten()[1:], label_smoothing=0.1)

    model.loss_function = smoothed
    with pytest.raises(OffloadError, match="loss_function is <function .*smoothed"):
        model(input_ids=ids, labels=ids)


def test_qlora_mlp_with_nf4_base_weights_tiles_like_the_untiled_module():
    """A QLoRA MLP (torchao NF4 base weights, frozen; fp32 LoRA adapters) in bf16: the tiled input gradient
    is the untiled one bitwise and the adapters' gradients agree within fp32 rounding (the NF4 weight is a
    parameter that wants no gradient: neither aliased nor refused as a tensor the module does not own)."""
    to_nf4 = pytest.importorskip("torchao.quantization", reason="torchao with NF4 is not installed").to_nf4

    class QLoRALinear(nn.Module):
        def __init__(self, n_in: int, n_out: int, r: int = 4) -> None:
            super().__init__()
            self.weight = nn.Parameter(to_nf4((torch.randn(n_out, n_in) * 0.05).to(torch.bfloat16)),
                                       requires_grad=False)
            self.lora_a = nn.Parameter(torch.randn(r, n_in) * 0.1)
            self.lora_b = nn.Parameter(torch.randn(n_out, r) * 0.1)

        def forward(self, x):
            return F.linear(x, self.weight) + ((x.float() @ self.lora_a.t()) @ self.lora_b.t()).to(x.dtype)

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = QLoRALinear(256, 512), QLoRALinear(512, 256)

        def forward(self, x):
            return self.down(F.silu(self.up(x)))

    torch.manual_seed(0)
    mlp = MLP()
    twin = copy.deepcopy(mlp)
    x = torch.randn(2, 96, 256, dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    twin(x2).float().pow(2).sum().backward()
    handle = tile_mlp(nn.Module(), modules=[mlp], tokens=32)
    mlp(x).float().pow(2).sum().backward()
    assert handle.stats()["tiles"] == 6 and torch.equal(x.grad, x2.grad)
    for (n, p), (_, q) in zip(mlp.named_parameters(), twin.named_parameters()):
        assert (p.grad is None) == (q.grad is None) == (not p.requires_grad), n
        if p.grad is not None:
            assert rel_diff(p.grad, q.grad) <= FP32_RTOL, n


@pytest.mark.parametrize("how", ["in_place", "replaced"])
def test_buffers_the_forward_updates_are_updated_once(how):
    """A per-token module that counts the tokens it saw in a buffer (as MoE load balancing does): the
    forward's tiles add up to the untiled count, and backward's recompute leaves the buffer as the forward
    did (it counted every token twice before), whether the module adds in place or assigns a new tensor."""

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            if how == "in_place":
                self.seen.add_(x.shape[-2])
            else:
                self.seen = self.seen + x.shape[-2]
            return torch.relu(self.fc(x))

    torch.manual_seed(0)
    m = Counting()
    twin = copy.deepcopy(m)
    x = torch.randn(1, 64, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    twin(x2).sum().backward()
    tile_mlp(nn.Module(), modules=[m], tokens=16)
    m(x).sum().backward()
    assert float(m.seen) == float(twin.seen) == 64
    assert torch.equal(x.grad, x2.grad) and rel_diff(m.fc.weight.grad, twin.fc.weight.grad) <= FP32_RTOL


# -- per-token calls of more than one tensor ------------------------------------------------------------


class _Routed(nn.Module):
    """GPT-OSS's MLP and transformers 4.x's mixtures of experts in miniature: returns the hidden states and
    the router's scores with the tokens flattened first, ``(tokens, experts)``."""

    def __init__(self, hidden: int = 8, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, hidden_states):
        b, t, h = hidden_states.shape
        flat = hidden_states.reshape(-1, h)
        scores = self.router(flat).softmax(-1)
        out = sum(scores[:, i:i + 1] * e(flat) for i, e in enumerate(self.experts))
        return out.reshape(b, t, h), scores


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Per-token math, within fp32 rounding: tiles of a few odd-sized rows take other CPU kernel paths (a
    vectorized op's scalar tail) than the untiled call (aligned tiles are bitwise: test_mlp_output_...)."""
    return a.shape == b.shape and rel_diff(a, b) <= 1e-6


def _compare_grads(tiled: nn.Module, twin: nn.Module) -> None:
    for (n, p), (_, q) in zip(tiled.named_parameters(), twin.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert rel_diff(p.grad, q.grad) <= FP32_RTOL, n


@pytest.mark.parametrize("tokens", [6, 8])  # 40 tokens: 6 tiles of 6 and one of 4 / 4 of 8, then 7 and 1
def test_a_module_returning_hidden_states_and_router_scores_is_tiled(tokens):
    """Each result of a per-token module is glued along the tokens into the untiled result's shape (the
    router's scores flattened, as GPT-OSS returns them): both results, the input's gradient and the
    parameters' within fp32 rounding, with both results in the loss. When every tile would have the same
    size, the last is split so that each result is seen to follow the tokens (a pooled result is refused:
    test_bad_inputs_are_refused_with_the_fix)."""
    torch.manual_seed(0)
    m, twin = _Routed(), None
    twin = copy.deepcopy(m)
    x = torch.randn(2, 20, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y2, s2 = twin(x2)
    (y2.pow(2).sum() + s2.max(-1).values.sum()).backward()
    handle = tile_mlp(nn.Module(), modules=[m], tokens=tokens)
    y, s = m(x)
    assert isinstance(m(x), tuple) and y.shape == y2.shape and s.shape == s2.shape
    assert _close(y, y2) and _close(s, s2)
    (y.pow(2).sum() + s.max(-1).values.sum()).backward()
    assert _close(x.grad, x2.grad)
    _compare_grads(m, twin)
    assert handle.stats()["tiles"] == (7 if tokens == 6 else 6)  # (the call backpropagated)


def test_a_result_nobody_uses_gets_no_gradient_and_is_not_kept():
    """The decoder drops the router's scores (GPT-OSS: ``hidden_states, _ = self.mlp(...)``): the tiled node
    keeps no reference to them (nor to the call's input beyond what autograd saved through the saved-tensor
    hooks, which an engine may offload), and backward runs with the one gradient it gets."""
    import gc
    import weakref

    torch.manual_seed(0)
    m = _Routed()
    twin = copy.deepcopy(m)
    tile_mlp(nn.Module(), modules=[m], tokens=6)
    leaf = torch.randn(1, 30, 8, requires_grad=True)
    x2 = leaf.detach().clone().requires_grad_()
    packed = []  # an engine that moved what was saved: copies, not the tensors
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.clone()) or len(packed) - 1,
                                                  lambda i: packed[i]):
        x = leaf * 1.0  # (a tensor of the graph, as a block's hidden states are)
        y, scores = m(x)
    gone = [weakref.ref(scores), weakref.ref(x)]
    del scores, x
    gc.collect()
    assert [r() for r in gone] == [None, None]
    y.sum().backward()
    twin(x2)[0].sum().backward()
    assert _close(leaf.grad, x2.grad)
    _compare_grads(m, twin)


def test_per_token_arguments_are_tiled_with_the_input():
    """Bloom's MLP takes the residual, DeepSeek-V4's mixture of experts the token ids (or None): each tensor
    argument with the tokens first is cut with the input, by position or keyword, and gets its gradient; the
    input may be passed by keyword; anything else goes to every tile unchanged."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.table = nn.Embedding(50, 8)

        def forward(self, hidden_states, residual, input_ids=None, scale=1.0, extra=None):
            out = torch.tanh(self.fc(hidden_states)) * scale + residual
            return out if input_ids is None else out + self.table(input_ids)

    torch.manual_seed(0)
    m = Mixed()
    twin = copy.deepcopy(m)
    x, r = torch.randn(2, 15, 8, requires_grad=True), torch.randn(2, 15, 8, requires_grad=True)
    ids = torch.randint(0, 50, (2, 15))
    x2, r2 = (t.detach().clone().requires_grad_() for t in (x, r))
    g = torch.randn(2, 15, 8)
    twin(hidden_states=x2, residual=r2, input_ids=ids, scale=0.5).backward(g)
    handle = tile_mlp(nn.Module(), modules=[m], tokens=4)
    y = m(hidden_states=x, residual=r, input_ids=ids, scale=0.5)
    assert _close(y, twin(x2, r2, input_ids=ids, scale=0.5))
    y.backward(g)
    assert _close(x.grad, x2.grad) and _close(r.grad, r2.grad)
    _compare_grads(m, twin)
    assert _close(m(x, r), twin(x, r)) and handle.stats()["calls"] == 1  # (calls backpropagated)


def test_a_result_recorded_by_the_modules_own_hook_keeps_its_gradient():
    """transformers 4.x recorded a mixture of experts' router logits from the block's own output (index 1)
    for the auxiliary loss: the block's own hooks run around the tiled call, so they see the glued result with
    its gradient, and the router gets the auxiliary loss's gradient as untiled."""
    torch.manual_seed(0)
    m = _Routed()
    twin = copy.deepcopy(m)
    recorded = {}
    for mod in (m, twin):
        mod.register_forward_hook(lambda mod, args, out: recorded.__setitem__(id(mod), out[1]))
    x = torch.randn(1, 24, 8)
    y2, _ = twin(x)
    (y2.sum() + recorded[id(twin)].pow(2).sum()).backward()
    tile_mlp(nn.Module(), modules=[m], tokens=5)
    y, _ = m(x)
    (y.sum() + recorded[id(m)].pow(2).sum()).backward()
    assert recorded[id(m)].grad_fn is not None
    _compare_grads(m, twin)


# -- what is per-token ------------------------------------------------------------------------------------


class _TokenShift(nn.Module):
    """RWKV's feed-forward in miniature: each token mixed with the one before it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.shift = nn.ZeroPad2d((0, 0, 1, -1))

    def forward(self, hidden_states):
        return self.fc(0.5 * hidden_states + 0.5 * self.shift(hidden_states))


def test_a_module_that_mixes_neighbouring_tokens_is_refused_at_its_first_call():
    """A feed-forward that shifts the tokens (RWKV's, found under the name feed_forward) would be cut at every
    tile's edge, silently: its first tiled call compares token 1 computed beside token 0 and beside token 2,
    and raises naming the fix. The real RWKV under long_context too."""
    m = _TokenShift()
    tile_mlp(nn.Module(), modules=[m], tokens=4)
    with pytest.raises(OffloadError, match=r"_TokenShift's result for a token depends on the tokens beside it.*"
                                           r"tiled_mlp=False"):
        m(torch.randn(1, 16, 8, requires_grad=True))
    cfg = transformers.RwkvConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, attention_hidden_size=16,
                                  intermediate_size=32, context_length=64)
    model = transformers.RwkvForCausalLM(cfg).train()
    handle = offload.long_context(model, mlp_tokens=8, device="cpu", min_offload_size=0)
    assert [n for n, _ in offload.tiling.find_mlps(model)] == ["rwkv.blocks.0.feed_forward", "rwkv.blocks.1.feed_forward"]
    ids = torch.randint(0, 64, (1, 24))
    with handle.engine, pytest.raises(OffloadError, match="RwkvFeedForward's result for a token depends"):
        model(input_ids=ids, labels=ids)


def test_the_per_token_check_draws_nothing_and_changes_no_buffer():
    """The check runs in eval mode (a dropout inside does not make a per-token module look token-mixing), and
    leaves the RNG (a module may draw in eval mode too) and the buffers as they were: a first tiled call
    (checked) and a second (not) from the same seed are equal, and the buffer counted each token once."""

    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.5)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, hidden_states):
            self.seen += hidden_states.shape[1]
            return self.drop(self.fc(hidden_states)) + 0.0 * torch.rand(())  # (a draw in eval mode too)

    m = Drop().train()
    handle = tile_mlp(nn.Module(), modules=[m], tokens=4)
    x = torch.randn(1, 18, 8)
    outs = []
    for _ in range(2):
        torch.manual_seed(3)
        outs.append(m(x))
    assert torch.equal(outs[0], outs[1]) and m.training and m.drop.training
    assert float(m.seen) == 36 and handle._per_token == {id(m)}


def test_feed_forward_modules_are_found_by_the_names_blocks_give_them():
    """find_mlps looks for each block's feed-forward by the names blocks use (mlp, feed_forward,
    block_sparse_moe, moe, ffn: Llama 4, Granite MoE, torchtitan, MPT...), the first that is a module."""

    class Block(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            setattr(self, name, nn.Linear(4, 4))
            self.attn = nn.Linear(4, 4)

    for name in ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn"):
        model = nn.Module()
        model.layers = nn.ModuleList(Block(name) for _ in range(3))
        assert [n for n, _ in offload.tiling.find_mlps(model)] == [f"layers.{i}.{name}" for i in range(3)]
    model = nn.Module()
    model.layers = nn.ModuleList(Block("dense") for _ in range(3))
    with pytest.raises(OffloadError, match=r"\.mlp, \.feed_forward, .*tiled_mlp=False"):
        offload.tiling.find_mlps(model)


def test_a_list_result_with_none_and_integer_entries_keeps_its_structure():
    """A result is returned as the module returns it: a list stays a list, a None stays None, an integer
    tensor (routed expert ids) is glued and carries no gradient; the float one does."""

    class Routes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, hidden_states):
            y = self.fc(hidden_states)
            return [y, None, y.argmax(-1)]

    torch.manual_seed(0)
    m = Routes()
    twin = copy.deepcopy(m)
    x = torch.randn(2, 11, 8)
    tile_mlp(nn.Module(), modules=[m], tokens=4)
    got, want = m(x), twin(x)
    assert type(got) is list and got[1] is None and got[2].dtype == torch.int64 and not got[2].requires_grad
    assert _close(got[0], want[0]) and torch.equal(got[2], want[2])
    got[0].sum().backward()
    want[0].sum().backward()
    _compare_grads(m, twin)
