"""A torchtitan / flame style training loop with activation offloading from its job config.

torchtitan-based trainers (flame) read ``activation_offload.mode`` from the
job config and, for ``full``, call torchtune's helper
``get_act_offloading_ctx_manager(model, enable)``; ``offload`` provides that
helper, so the loop below is theirs with one import changed. Extra engine
settings may sit in the same section (any ``offload.OffloadConfig`` field).

Runbook (``PYTHONPATH=.`` from the repo root, or after ``pip install -e .``):
    python examples/torchtitan_style.py                 # CPU: device="cpu" runs the real copies
    python examples/torchtitan_style.py --mode none     # the same loop without offloading
On a GPU, drop ``device: cpu`` from the config: the engine then uses the current accelerator.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is a repo tool: run from a checkout
from bench.model import ToyLlama, ToyLlamaConfig, make_batch
from offload.integrations.torchtitan import config_from_section, ctx_for_mode

JOB_CONFIG = """
training:
  steps: 3
  batch_size: 2
  seq_len: 64
  gradient_accumulation_steps: 2
activation_offload:
  mode: full              # torchtitan / flame: none | full
  device: cpu             # offload.OffloadConfig fields from here on
  min_offload_size: 1024
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["none", "full"], default=None, help="override activation_offload.mode")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # steady timings on a shared CPU

    job = yaml.safe_load(JOB_CONFIG)
    if args.mode is not None:
        job["activation_offload"]["mode"] = args.mode
    if torch.cuda.is_available():
        job["activation_offload"].pop("device")
    mode, offload_cfg = config_from_section(job["activation_offload"])
    train = job["training"]

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ToyLlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=2, max_seq_len=train["seq_len"])
    torch.manual_seed(0)  # same weights in both modes: offloading changes no bit of the loss
    model = ToyLlama(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The one line flame runs for `activation_offload.mode: full` (torchtune's helper signature).
    ctx = ctx_for_mode(model, mode, config=offload_cfg)

    for step in range(1, train["steps"] + 1):
        opt.zero_grad()
        for micro in range(train["gradient_accumulation_steps"]):
            x, y = make_batch(cfg, train["batch_size"], train["seq_len"], device=device, seed=step * 100 + micro)
            with ctx:  # forward inside, backward outside (torchtune's usage)
                logits = model(x)  # (B, T, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / train["gradient_accumulation_steps"]
            loss.backward()
        opt.step()
        line = f"step {step}  loss {loss.item() * train['gradient_accumulation_steps']:.4f}"
        if mode == "full":
            t = ctx.ledger.step_totals[-1]
            line += f"  offloaded {t.offloaded_bytes / 2**20:.2f} MiB  kept {t.kept_bytes / 2**20:.2f} MiB"
        print(line)
    if mode == "full":
        print(ctx.ledger.report())


if __name__ == "__main__":
    main()
