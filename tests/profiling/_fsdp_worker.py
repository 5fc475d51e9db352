"""One-process gloo FSDP2 run under the MemProfiler (run by test_prof_fsdp.py in a subprocess).

Usage: python tests/profiling/_fsdp_worker.py OUT_DIR [cpu|cuda]
Prints one JSON line with what the test checks. A subprocess keeps the
process group and FSDP's global state out of the pytest process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench.model import ToyLlama, ToyLlamaConfig, make_batch
from offload.profiling import MemProfiler, MemProfilerCfg


def main(out: Path, device: str) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{out / 'pg_init'}", rank=0, world_size=1)
    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        model = ToyLlama(ToyLlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=2)).to(device)
        mesh = init_device_mesh(device, (1,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens, targets = make_batch(model.cfg, 2, 16, device=device)
        cfg = MemProfilerCfg(enabled=True, save_dir=out, track_fsdp_mem=True, dump_memorystats_pickle=True,
                             fsdp_mem_track_module_depth=3)
        prof = MemProfiler(cfg, model, optimizer=opt)
        for _ in range(3):
            with prof.profile("training_step", inputs=(tokens,)):
                logits = model(tokens)
                F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
                opt.step()
                opt.zero_grad()
        end = prof.memory_stats.get("0.training_step.2.end", {})
        print(json.dumps({
            "rank": prof.rank,
            "files": sorted(p.name for p in out.iterdir()),
            "fsdp_peak": {k: v for k, v in end.items() if k.startswith("fsdp.")},
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "tokens_storage_bytes": tokens.untyped_storage().nbytes(),
            "npp_diff": end.get("npp_diff"),
        }))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu")
