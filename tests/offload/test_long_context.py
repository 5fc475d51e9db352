"""offload.long_context(model): AC + offloaded checkpoint inputs + tiled MLP + tiled loss in one call.

Twin pattern: the model under the strategy and its untouched ``copy.deepcopy`` run the same step; the
loss and every gradient agree within fp32 rounding (the tiles reorder sums over tokens, NOTE [ Tiles ]).
"""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.planner.meter import measure_step

transformers = pytest.importorskip("transformers")

RTOL = 1e-5


def llama(layers: int = 2, vocab: int = 300) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=176,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).train()


def step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close(got, ref):
    (gl, gg), (rl, rg) = got, ref
    assert float((gl - rl).abs() / rl.abs()) <= RTOL
    for n in rg:
        d = float((gg[n] - rg[n]).abs().max() / rg[n].abs().max())
        assert d <= RTOL, (n, d)


def test_long_context_step_matches_the_plain_step_and_offloads_the_checkpoint_inputs():
    """One call installs all four parts: gradients within fp32 rounding of the plain model's, the block
    inputs offloaded (at least layers x tokens x hidden x 4 bytes), both tiles in the ledger; remove()
    gives back the plain model bitwise."""
    model = llama()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 300, (2, 200))
    ref = step(twin, ids)
    h = offload.long_context(model, device="cpu", mlp_tokens=48, loss_tokens=64)
    assert h.checkpointing == "offload" and h.mlp is not None and h.loss is not None
    assert_close(step(model, ids), ref)
    s = h.engine.ledger.summary()
    assert s["offloaded_bytes"] >= 2 * 2 * 200 * 64 * 4
    assert s["tiling"]["mlp"]["tiles"] == 2 * 9 and s["tiling"]["loss"]["tiles"] == 7
    h.remove()
    again = step(model, ids)
    assert torch.equal(again[0], ref[0]) and all(torch.equal(again[1][n], ref[1][n]) for n in ref[1])
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_report_names_the_host_tiers_and_what_did_not_fit(tmp_path):
    """report(): a pool budget below one step's checkpoint inputs spills to the disk tier (named, with the
    bytes it took); without a disk tier the rest stays on the device and the report says how to fix it."""
    ids = torch.randint(0, 300, (1, 256))
    with_disk = offload.long_context(llama(), device="cpu", min_offload_size=0, host_budget_bytes="64KiB",
                                     disk_dir=str(tmp_path / "spill"))
    step(with_disk.engine._model_ref(), ids)
    text = with_disk.report()
    assert "disk " + str(tmp_path / "spill") in text and "disk " in text.splitlines()[2]
    assert with_disk.engine.ledger.summary()["tiers"]["disk"]["bytes"] > 0
    with_disk.engine.close()
    no_disk = offload.long_context(llama(), device="cpu", min_offload_size=0, host_budget_bytes="64KiB")
    step(no_disk.engine._model_ref(), ids)
    assert "stayed on the device" in no_disk.report() and "disk_dir" in no_disk.report()


def test_tiles_lower_the_peak_of_ac_plus_offload():
    """MemTracker on CPU (host pool left out): long_context peaks lower than the same AC + offload without
    the tiles (offload_ac), and lower than AC alone."""
    ids = torch.randint(0, 4096, (1, 1024))

    def peak(**kw) -> int:
        model = llama(vocab=4096)
        h = offload.long_context(model, device="cpu", **kw)
        try:
            return measure_step(lambda: model(input_ids=ids, labels=ids).loss.backward(), device="cpu", model=model,
                                pools=[h.engine.pool], warmup=1, timed=0).peak_bytes
        finally:
            h.remove()

    tiled = peak(mlp_tokens=128, loss_tokens=128)
    offload_ac = peak(tiled_mlp=False, tiled_loss=False)
    assert tiled < offload_ac - 1024 * 4096 * 4 // 2, (tiled, offload_ac)


def test_uses_the_models_own_checkpointing_and_leaves_other_losses_untiled():
    """A Hugging Face model with gradient checkpointing on is not checkpointed twice; a model that is not
    a Hugging Face causal LM (the bench's toy Llama) gets the MLP tiled and its loss left to the user."""
    model = llama()
    twin = copy.deepcopy(model)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    ids = torch.randint(0, 300, (1, 200))
    h = offload.long_context(model, device="cpu", mlp_tokens=32)
    assert h.checkpointing == "transformers"
    assert_close(step(model, ids), step(twin, ids))

    from bench.model import ToyLlama, ToyLlamaConfig

    toy = ToyLlama(ToyLlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=256))
    h = offload.long_context(toy, device="cpu")
    assert h.loss is None and h.mlp is not None and h.checkpointing == "offload"
    toy(torch.randint(0, 64, (1, 200))).sum().backward()
    assert h.engine.ledger.summary()["tiling"]["mlp"]["calls"] == 2
