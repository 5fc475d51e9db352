"""Real model code: tiny random Hugging Face models of 23 architectures, bitwise under offloading.

Each model runs one training step under ``get_act_offloading_ctx_manager``
(``device="cpu"``: the engine really copies every saved activation to its host
pool and back) and its ``copy.deepcopy`` twin the same step without; loss and
every gradient must be equal bit for bit. The architectures cover what the toy
models do not: Conv1D (GPT-2), ALiBi (Bloom), MoE routing (Mixtral, Qwen2-MoE, GPT-OSS, Llama 4, Granite MoE),
soft-capping (Gemma 2), encoder-decoder with relative position buckets (T5,
BART), encoders (BERT, RoBERTa, ViT) and a state-space model (Mamba). A
language model's head must be found and excluded; a classifier has none.
With ``checkpointing`` on (non-reentrant), the engine sees the checkpoints'
inputs. CI's first pass runs all of it through the C++ pack hook (``native_hooks="auto"``), its
``--python-hooks`` pass through the Python hook. Each causal LM also runs under ``offload.long_context``
(tiles: within fp32 rounding of the plain step).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from offload import get_act_offloading_ctx_manager
from offload.compat.trl import _checkpointing_entry

transformers = pytest.importorskip("transformers")
T = transformers

V = 96  # vocabulary
_SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
_GQA = dict(_SMALL, num_key_value_heads=2)


def _ids() -> torch.Tensor:
    return torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(1))


def _lm() -> dict:
    ids = _ids()
    return dict(input_ids=ids, labels=ids)


def _seq2seq() -> dict:
    ids = _ids()
    return dict(input_ids=ids, labels=ids[:, :8].clone())


def _classify() -> dict:
    return dict(input_ids=_ids(), labels=torch.tensor([0, 1]))


def _image() -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g), labels=torch.tensor([0, 1]))


# name: (config class, model class, config kwargs, inputs, has an LM head)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _GQA, _lm, True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _GQA, _lm, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_GQA, head_dim=8), _lm, True),
    "mistral": ("MistralConfig", "MistralForCausalLM", _GQA, _lm, True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_GQA, head_dim=8), _lm, True),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_GQA, head_dim=8), _lm, True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_GQA, pad_token_id=0, eos_token_id=1, bos_token_id=2), _lm, True),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_GQA, num_local_experts=4, num_experts_per_tok=2),
                _lm, True),
    # its MLP returns the hidden states and the router's scores (tiled: both glued along the tokens)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_GQA, head_dim=8, num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention",
                     "full_attention"], sliding_window=8), _lm, True),
    # the feed-forward is named feed_forward (a mixture of experts with a shared expert) / block_sparse_moe
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(_GQA, head_dim=8, num_local_experts=4, use_cache=False,
                                                             intermediate_size_mlp=64, num_experts_per_tok=1), _lm, True),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(_GQA, num_local_experts=4, num_experts_per_tok=2, use_cache=False), _lm, True),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16), _lm, True),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=1),
             _lm, True),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _SMALL, _lm, True),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=4, word_embed_proj_dim=32), _lm, True),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=V, hidden_size=32, n_layer=2, n_head=4), _lm, True),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4), _lm, True),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=V, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, decoder_start_token_id=0),
           _seq2seq, True),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64), _seq2seq, True),
    "bert": ("BertConfig", "BertForSequenceClassification", _SMALL, _classify, False),
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification", _SMALL, _classify, False),
    "vit": ("ViTConfig", "ViTForImageClassification",
            dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                 patch_size=8), _image, False),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                      state_size=4), _lm, True),
}


def _build(name: str) -> torch.nn.Module:
    cfg_name, model_name, kw, _, _ = ARCHS[name]
    cfg_cls, model_cls = getattr(T, cfg_name, None), getattr(T, model_name, None)
    if cfg_cls is None or model_cls is None:
        pytest.skip(f"transformers {T.__version__} has no {model_name}")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference-implementation notices of some models
        model = model_cls(cfg_cls(**kw))
    model.train()
    return model


def _step(model: torch.nn.Module, inputs: dict, ctx=None) -> torch.Tensor:
    torch.manual_seed(5)  # the same dropout masks in both runs
    if ctx is None:
        out = model(**inputs)
    else:
        with ctx:
            out = model(**inputs)
    out.loss.backward()
    return out.loss.detach()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_hf_architecture_bitwise_under_offloading(name, checkpointing):
    model = _build(name)
    if checkpointing:
        enable, kwargs_name = _checkpointing_entry(model)  # transformers >= 5 renamed both
        getattr(model, enable)(**{kwargs_name: {"use_reentrant": False}})
    twin = copy.deepcopy(model)
    inputs = ARCHS[name][3]()
    has_head = ARCHS[name][4]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no output head" for the classifiers: expected there
        ctx = get_act_offloading_ctx_manager(model, True, device="cpu", min_offload_size=0)
    loss = _step(model, inputs, ctx)
    assert torch.equal(loss, _step(twin, inputs))
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), n
    s = ctx.ledger.summary()
    assert s["offloaded_count"] > 0 and s["offloaded_bytes"] > 0
    assert s["packed_count"] == s["offloaded_count"] + s["kept_count"]
    kept = s["kept_count_by_reason"]
    if has_head:  # found and excluded: its saved input stays on the device
        assert kept.get("excluded_region", 0) >= 1, kept
    else:
        assert "excluded_region" not in kept, kept
    # Rule 7: no parameter or buffer storage was moved.
    static = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    moved = [r for r in ctx.ledger.records if r.decision == "offloaded" and r.storage_key in static]
    assert not moved, moved[:3]


def test_fused_head_work_after_the_body_stays_on_the_device(recwarn):
    """A fused head (TRL's SFTTrainer: the body's output times lm_head.weight, in chunks, no lm_head
    call) still keeps the head's work on the device: get_act_offloading_ctx_manager keeps what runs
    after the body (``after_head``), and does not warn that the unused head exclusion excluded nothing."""
    model = _build("llama")
    twin = copy.deepcopy(model)
    ids = _ids()

    def fused_loss(m):
        hidden = m.model(input_ids=ids).last_hidden_state
        losses = [torch.nn.functional.cross_entropy((h @ m.lm_head.weight.t()).flatten(0, 1), t.flatten())
                  for h, t in zip(hidden.chunk(2, dim=1), ids.chunk(2, dim=1))]
        return sum(losses)

    ctx = get_act_offloading_ctx_manager(model, True, device="cpu", min_offload_size=0)
    with ctx:
        loss = fused_loss(model)
    loss.backward()
    fused_loss(twin).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    records = list(ctx.ledger.records)
    body_done = max(i for i, r in enumerate(records) if r.module)  # the last save inside a module
    tail = records[body_done + 1:]
    assert tail and all(r.decision == "kept" for r in tail), [(r.module, r.reason) for r in tail]
    assert {r.reason for r in tail} >= {"after_head"}
    assert not [w for w in recwarn if "nothing was excluded" in str(w.message)]


def _no_dropout(model: torch.nn.Module) -> None:
    """Dropout off: the tiles draw their masks per tile, so with dropout a tiled step and its untiled twin
    differ by the draws, not by a mistake."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for k in ("attention_dropout", "attn_pdrop", "hidden_dropout", "resid_pdrop", "embd_pdrop", "dropout"):
        if isinstance(getattr(model.config, k, None), float):
            setattr(model.config, k, 0.0)


@pytest.mark.parametrize("name", [n for n, a in ARCHS.items() if a[4] and a[3] is _lm])
def test_hf_causal_lm_under_long_context_matches_the_plain_step(name):
    """offload.long_context (checkpointed blocks with offloaded inputs, tiled MLP, tiled labels= loss) on each
    causal LM: loss and every gradient within fp32 rounding of the plain step (the tiles reorder sums over
    tokens). A model without an MLP the tiles can find (none named .mlp: OPT, Mamba) is refused at setup with
    an error naming tiled_mlp=False, and the strategy then runs without it. Found by running this: Falcon's
    blocks add into the tiled output in place (torch raised); Bloom's MLP takes the residual too and GPT-OSS's
    returns the router's scores too (both were refused; now cut and glued along the tokens)."""
    from offload import OffloadError, long_context

    model = _build(name)
    _no_dropout(model)
    twin = copy.deepcopy(model)
    ids = torch.randint(3, V, (2, 40), generator=torch.Generator().manual_seed(2))
    ref_loss = _step(twin, dict(input_ids=ids, labels=ids))
    try:
        handle = long_context(model, mlp_tokens=16, loss_tokens=16, device="cpu", min_offload_size=0)
    except OffloadError as e:
        assert "tiled_mlp=False" in str(e) and name in ("opt", "mamba"), str(e)
        handle = long_context(model, tiled_mlp=False, loss_tokens=16, device="cpu", min_offload_size=0)
    with handle.engine:
        loss = _step(model, dict(input_ids=ids, labels=ids))
    assert float((loss - ref_loss).abs()) <= 1e-5 * float(ref_loss.abs())
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:  # (a key bias's gradient is ~0 by softmax's shift invariance: scaled by the largest)
            scale = max(float(g.grad.abs().max()) for g in twin.parameters() if g.grad is not None)
            assert float((p.grad - q.grad).abs().max()) <= 1e-5 * max(float(q.grad.abs().max()), 1e-3 * scale), n
    assert handle.loss.stats()["calls"] == 1 and (handle.mlp is None or handle.mlp.stats()["calls"] == 2)
    assert handle.engine.ledger.summary()["offloaded_count"] > 0
