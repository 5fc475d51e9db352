"""OffloadCallback(long_context=True / tiled_mlp / tiled_loss) in a real transformers.Trainer on CPU.

The same tiny Llama trains twice, with the long-context callback and without any offloading; every
trainable gradient before each optimizer step must agree within fp32 rounding (the tiles reorder sums
over tokens: NOTE [ Tiles ]), the engine must have offloaded the checkpoint inputs and the ledger must
count the tiles; at train end the model is as it was.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from offload.integrations.hf import OffloadCallback  # noqa: E402

STEPS, BATCH, SEQ, VOCAB = 2, 2, 128, 128
RTOL = 1e-5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = STEPS * BATCH) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _GradCapture(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


def _train(tmp_path, name: str, callback: OffloadCallback | None, **args_kw) -> tuple[_GradCapture, Trainer]:
    cap = _GradCapture()
    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             learning_rate=1e-3, report_to="none", save_strategy="no", use_cpu=True, seed=0,
                             data_seed=0, dataloader_num_workers=0, disable_tqdm=True, **args_kw)
    trainer = Trainer(model=_model(), args=args, train_dataset=_Data(),
                      callbacks=[cap] + ([callback] if callback is not None else []))
    trainer.train()
    return cap, trainer


def _assert_close(got: _GradCapture, want: _GradCapture) -> None:
    assert len(got.steps) == len(want.steps) == STEPS
    for g, w in zip(got.steps, want.steps):
        assert g.keys() == w.keys() and w
        for n, ref in w.items():
            d = float((g[n].double() - ref.double()).abs().max() / ref.double().abs().max())
            assert d <= RTOL, (n, d)


@pytest.mark.parametrize("gc", [False, True])
def test_long_context_callback_trains_like_the_plain_trainer(tmp_path, gc):
    """long_context=True: gradients within fp32 rounding of a run without offloading, checkpoint inputs
    offloaded, both tiles counted in the ledger; the Trainer's own gradient checkpointing is used when on;
    at train end no forward of the model is replaced any more."""
    ac = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ \
        else "gradient_checkpointing"
    kw = {ac: True, f"{ac}_kwargs": {"use_reentrant": False}} if gc else {}
    cb = OffloadCallback(device="cpu", long_context=True)
    got, trainer = _train(tmp_path, "lc", cb, **kw)
    want, _ = _train(tmp_path, "plain", None, **kw)
    _assert_close(got, want)
    s = cb.engine.ledger.summary()
    assert s["offloaded_bytes"] >= STEPS * 2 * BATCH * SEQ * 64 * 4  # two layers' inputs a step
    assert s["tiling"]["mlp"]["calls"] == STEPS * 2 and s["tiling"]["mlp"]["tiles"] == STEPS * 2 * 4
    assert s["tiling"]["loss"]["calls"] == STEPS and s["tiling"]["loss"]["bytes_not_saved"] > 0
    assert not any("forward" in m.__dict__ for m in trainer.model.modules())


def test_tiles_alone_and_bad_flags(tmp_path):
    """tiled_mlp=True alone tiles the MLP and leaves the loss; a flag that is no bool, or long_context with a
    budget, is refused when the callback is built."""
    cb = OffloadCallback(device="cpu", tiled_mlp=True)
    got, _ = _train(tmp_path, "mlp", cb)
    want, _ = _train(tmp_path, "plain", None)
    _assert_close(got, want)
    s = cb.engine.ledger.summary()["tiling"]
    assert s["mlp"]["calls"] > 0 and s["loss"]["calls"] == 0
    with pytest.raises(TypeError, match="tiled_loss='yes'"):
        OffloadCallback(tiled_loss="yes")
    with pytest.raises(ValueError, match="long_context=True"):
        OffloadCallback(long_context=True, budget="80%")
    with pytest.raises(TypeError, match="tiled_mlp"):
        OffloadCallback(tiled_mpl=True)


def test_lightning_long_context_trains_like_the_plain_trainer(tmp_path):
    """lightning OffloadCallback(long_context=True) on a LightningModule whose .model is the toy Llama: the
    blocks checkpointed and their inputs offloaded, the MLP tiled (the toy's own loss is left to the user:
    tiled_loss would be refused), gradients within fp32 rounding of a run without the callback; at train
    end no forward is replaced."""
    pl = pytest.importorskip("lightning.pytorch")
    import torch.nn.functional as F

    from bench.model import ToyLlama, ToyLlamaConfig
    from offload.integrations.lightning import OffloadCallback as LightningCallback

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = ToyLlama(ToyLlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=SEQ))
            self.grads: list[dict[str, torch.Tensor]] = []

        def training_step(self, batch, batch_idx):
            logits = self.model(batch[0])
            return F.cross_entropy(logits.flatten(0, 1), batch[0].flatten())

        def on_before_optimizer_step(self, optimizer):
            self.grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters()})

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ids = torch.randint(0, 64, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    runs = []
    for cb in (LightningCallback(device="cpu", long_context=True, tiled_loss=False), None):
        module = LM()
        trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                             callbacks=[cb] if cb else [], enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH))
        runs.append((module, cb))
    (on, cb), (off, _) = runs
    assert len(on.grads) == len(off.grads) == STEPS
    for g, w in zip(on.grads, off.grads):
        for n, ref in w.items():
            assert float((g[n] - ref).abs().max() / ref.abs().max()) <= RTOL, n
    s = cb.engine.ledger.summary()
    assert s["offloaded_bytes"] > 0 and s["tiling"]["mlp"]["calls"] == STEPS * 2
    assert not any("forward" in m.__dict__ for m in on.modules())
