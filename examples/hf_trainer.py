"""Activation offloading in a Hugging Face ``Trainer``: one callback, the ledger in the Trainer's logs.

``OffloadCallback`` attaches the engine to the model at train begin (the
output head and the loss stay on the device), detaches at train end, and adds
``offload/offloaded_bytes``, ``offload/kept_bytes``, ``offload/exposed_copy_s``
and the pool's bytes to every training log, so ``report_to`` (TensorBoard,
W&B...) records them. The same line works with TRL's ``SFTTrainer``, PEFT
models and ``gradient_checkpointing=True``.

The model is a tiny randomly initialised Llama built from a config (no
download). Runbook (``pip install -e ".[hf]"``, or ``PYTHONPATH=.`` from the repo root):
    python examples/hf_trainer.py                # CPU: device="cpu" runs the real copies
    python examples/hf_trainer.py --steps 20     # on a GPU, unchanged (the engine uses the accelerator)
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from offload.integrations.hf import OffloadCallback


class RandomTokens(torch.utils.data.Dataset):
    """Random token sequences as causal-LM examples (labels = inputs)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # steady timings on a shared CPU

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq)
    model = LlamaForCausalLM(config)
    on_gpu = torch.cuda.is_available()
    offload = OffloadCallback(device=None if on_gpu else "cpu")  # the one line

    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=2,
                                          logging_steps=1, report_to="none", save_strategy="no",
                                          use_cpu=not on_gpu, disable_tqdm=True)
        trainer = Trainer(model=model, args=training_args, callbacks=[offload],
                          train_dataset=RandomTokens(2 * args.steps, args.seq, config.vocab_size))
        trainer.train()

    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']}  loss {entry['loss']:.4f}  offloaded "
                  f"{entry['offload/offloaded_bytes'] / 2**20:.2f} MiB  kept {entry['offload/kept_bytes'] / 2**20:.2f} MiB"
                  f"  exposed copy {entry['offload/exposed_copy_s'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
