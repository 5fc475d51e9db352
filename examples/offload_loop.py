"""(a) Activation offloading in a plain PyTorch training loop.

Wrap the forward pass in ``OffloadActivations``; run the loss and backward
outside it. Tensors autograd saves during the forward move to host memory as
they are saved and come back (prefetched) during backward; the ledger says
what moved, what stayed and why.

Runbook (after ``pip install -e .``, or with ``PYTHONPATH=.`` from the repo root):
    python examples/offload_loop.py                       # CPU: tiny model, device="cpu" runs the real copies
    python examples/offload_loop.py --dim 2048 --layers 8 --seq 4096 --steps 20   # on a GPU, unchanged
On CPU it runs with one intra-op thread (``--threads``), so its timings are steady on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is a repo tool: run from a checkout
from bench.model import ToyLlama, ToyLlamaConfig, make_batch
from offload import OffloadActivations

MiB = 2**20


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU (default 1: steady timings on a shared machine; "
                        "0 = torch's own choice); ignored on a GPU")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and args.threads:
        torch.set_num_threads(args.threads)  # steady CPU timings: no intra-op workers waiting on each other

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = ToyLlamaConfig(vocab_size=512, dim=args.dim, n_layers=args.layers,
                         n_heads=max(1, args.dim // 64), max_seq_len=args.seq)
    model = ToyLlama(cfg).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # device=None offloads from the current accelerator; with none present it would run
    # pass-through (nothing moved), so on a CPU-only machine ask for device="cpu".
    ctx = OffloadActivations(device=None if cuda else "cpu")

    for step in range(args.steps):
        tokens, targets = make_batch(cfg, args.batch, args.seq, device=device, seed=step)
        with ctx:
            logits = model(tokens)  # (B, T, V): saved activations leave the device here
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()  # outside the context: activations come back, prefetched
        opt.step()
        opt.zero_grad(set_to_none=True)
        # The step closes at the end of each backward; a StepTotals prints as one line.
        print(f"{ctx.ledger.step_totals[-1]} | loss {loss.item():.4f}")

    print(ctx.ledger.report())  # by decision and kept reason, over every step
    pool = ctx.ledger.summary()["pool"]
    print(f"host pool: {pool['reserved_bytes'] / MiB:.1f} MiB reserved, {pool['allocations']} allocations, "
          f"{pool['reuses']} reuses (a static-shape loop only allocates in its first step)")


if __name__ == "__main__":
    main()
