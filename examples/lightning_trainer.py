"""Activation offloading in a Lightning ``Trainer``: one callback, the ledger through ``log_dict``.

``OffloadCallback`` enters the engine when each training batch starts and
leaves it before that batch's backward, whatever ``training_step`` calls;
the output head stays on the device. After each batch it logs
``offload/offloaded_bytes``, ``offload/kept_bytes``, ``offload/exposed_copy_s``
and the pool's bytes with ``pl_module.log_dict``, so every Lightning logger
records them.

Runbook (``pip install -e ".[lightning]"``, or ``PYTHONPATH=.`` from the repo root):
    python examples/lightning_trainer.py                # CPU: device="cpu" runs the real copies
    python examples/lightning_trainer.py --steps 20     # on a GPU, unchanged
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is a repo tool: run from a checkout
from bench.model import ToyLlama, ToyLlamaConfig, make_batch
from offload.integrations.lightning import OffloadCallback


class ToyLM(pl.LightningModule):
    def __init__(self, cfg: ToyLlamaConfig) -> None:
        super().__init__()
        self.model = ToyLlama(cfg)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("loss", loss, on_step=True, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class PrintFigures(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        if "offload/offloaded_bytes" in m:
            print(f"step {trainer.global_step}  loss {m['loss']:.4f}  offloaded "
                  f"{m['offload/offloaded_bytes'] / 2**20:.2f} MiB  kept {m['offload/kept_bytes'] / 2**20:.2f} MiB")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # steady timings on a shared CPU

    torch.manual_seed(0)
    cfg = ToyLlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=2, max_seq_len=args.seq)
    xs, ys = zip(*(make_batch(cfg, 2, args.seq, seed=i) for i in range(args.steps)))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=2)
    on_gpu = torch.cuda.is_available()
    offload = OffloadCallback(device=None if on_gpu else "cpu")  # the one line
    with tempfile.TemporaryDirectory() as out:
        trainer = pl.Trainer(max_steps=args.steps, accelerator="gpu" if on_gpu else "cpu", devices=1,
                             callbacks=[offload, PrintFigures()], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
        trainer.fit(ToyLM(cfg), data)


if __name__ == "__main__":
    main()
