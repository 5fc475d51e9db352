"""One rank of the distributed reliability checks (run as a script, one process per rank).

Modes: ddp; ddp with activation checkpointing and find_unused_parameters;
fsdp2; fsdp2 with activation checkpointing; fsdp2 with bf16 mixed precision;
fsdp2 through get_act_offloading_ctx_manager (head excluded). For each, it
trains a ToyLlama twin pair for a few SGD steps, one with the forward inside
``OffloadActivations`` and one without, and writes what it saw to ``<out>/result_rank<r>.json`` for the test to judge:
loss/grad/param mismatches, parameter-like tensors that were offloaded, the
ledger summary, and the per-rank ledger (and MemProfiler, when present) files.

    python tests/reliability/_dist_worker.py --rank 0 --world-size 2 \
        --init-method file:///tmp/x/init --out /tmp/x   # and --rank 1 alongside
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after $PYTHONPATH, so an installed or overridden tree wins

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from bench.model import ToyLlama, ToyLlamaConfig, make_batch  # noqa: E402

CFG = ToyLlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, max_seq_len=128)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _wrap(model: torch.nn.Module, mode: str, mesh, device: torch.device) -> torch.nn.Module:
    if mode.startswith("ddp"):
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                   find_unused_parameters=mode.endswith("_unused"))
    kw = {}
    if mode == "fsdp2_mp":  # bf16 compute params gathered from fp32 shards, fp32 grad reduction
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _live_param_ptrs(model: torch.nn.Module) -> set[int]:
    """Storages of every tensor registered as a parameter right now (FSDP2 swaps in
    unsharded params during forward) plus the local shards of sharded ones."""
    ptrs = set()
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                ptrs.add(_local(p).untyped_storage().data_ptr())
    return ptrs


def run_mode(mode: str, rank: int, world: int, device: torch.device, steps: int, out: Path) -> dict:
    from offload import OffloadActivations, get_act_offloading_ctx_manager, is_static_tensor

    torch.manual_seed(0)
    base = ToyLlama(CFG).to(device)
    base.checkpoint_blocks = "_ac" in mode
    ref_raw = type(base)(CFG).to(device)
    ref_raw.load_state_dict(base.state_dict())
    ref_raw.checkpoint_blocks = base.checkpoint_blocks
    mesh = init_device_mesh(device.type, (world,)) if mode.startswith("fsdp2") else None
    ref = _wrap(ref_raw, mode, mesh, device)
    off = _wrap(base, mode, mesh, device)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_off = torch.optim.SGD(off.parameters(), lr=0.1)

    kw = dict(device="cpu" if device.type == "cpu" else None, min_offload_size=0)
    if mode == "fsdp2_head":  # torchtune's helper: head excluded, the (sharded) model given up front
        ctx = get_act_offloading_ctx_manager(off, True, **kw)
    else:
        ctx = OffloadActivations(**kw)
    violations: list[str] = []
    seen = {"dtensor_packs": 0, "offloaded_packs": 0, "param_kept": 0}

    seen["param_like_bytes"] = 0

    def observe(ev) -> None:
        t, rec = ev.tensor, ev.record
        if isinstance(t, DTensor):
            seen["dtensor_packs"] += 1
        if isinstance(t, DTensor) or is_static_tensor(t) or _local(t).untyped_storage().data_ptr() in _live_param_ptrs(off):
            seen["param_like_bytes"] += rec.nbytes
        if rec.decision != "offloaded":
            if rec.reason == "parameter":
                seen["param_kept"] += 1
            return
        seen["offloaded_packs"] += 1
        if isinstance(t, DTensor) or is_static_tensor(t):
            violations.append(f"offloaded a parameter-like tensor {tuple(t.shape)} in {rec.module!r}")
        elif t.untyped_storage().data_ptr() in _live_param_ptrs(off):
            violations.append(f"offloaded a view of a live parameter storage {tuple(t.shape)} in {rec.module!r}")

    handle = ctx.add_observer(observe)
    prof_dir = out / f"memprof_{mode}_rank{rank}"
    prof = _profiler(off, ctx, prof_dir, mode)
    res = {"loss_mismatch": [], "grad_mismatch": [], "param_mismatch": [], "losses": []}
    for step in range(steps):
        tokens, targets = make_batch(CFG, 2, 16 + 4 * step, device=device, seed=100 * rank + step)
        losses = []
        for model, c in ((ref, None), (off, ctx)):
            with prof.profile("training_step", inputs=(tokens,)) if c is not None else contextlib.nullcontext():
                with c if c is not None else contextlib.nullcontext():
                    logits = model(tokens)  # (B, T, vocab)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                loss.backward()
            losses.append(loss.detach())
        if not torch.equal(losses[0], losses[1]):
            res["loss_mismatch"].append(step)
        res["losses"].append([losses[0].item(), losses[1].item()])
        for (name, p), (_, q) in zip(ref.named_parameters(), off.named_parameters()):
            if not torch.equal(_local(p.grad), _local(q.grad)):
                res["grad_mismatch"].append(f"step {step}: {name}")
        opt_ref.step(), opt_off.step()
        opt_ref.zero_grad(), opt_off.zero_grad()
    prof_files = prof.close()
    for (name, p), (_, q) in zip(ref.named_parameters(), off.named_parameters()):
        if not torch.equal(_local(p.detach()), _local(q.detach())):
            res["param_mismatch"].append(name)
    handle.remove()
    ledger_path = out / f"ledger_{mode}_rank{rank}.json"
    ctx.ledger.to_json(str(ledger_path))
    res.update(
        violations=violations,
        seen=seen,
        summary=ctx.ledger.summary(),
        ledger_path=str(ledger_path),
        profile_files=sorted(str(p) for p in prof_dir.rglob("*") if p.is_file()),
        profile_written=[str(p) for p in prof_files],
        profile_keys=sorted(getattr(prof, "memory_stats", {})),
        profiler=type(prof).__name__,
    )
    return res


def _profiler(model: torch.nn.Module, ctx, path: Path, mode: str):
    """A MemProfiler collecting the 2nd training_step (1 warm-up) into ``path``; for FSDP2 also
    its FSDPMemTracker report. The ``_NoProfiler`` stand-in is used while profiling lacks it."""
    try:
        from offload.profiling import MemProfiler, MemProfilerCfg, MemProfilerFuncs
    except ImportError:
        return _NoProfiler()
    fsdp = mode == "fsdp2"
    funcs = MemProfilerFuncs(default=frozenset({"training_step"}),
                             fsdp=frozenset({"training_step"}) if fsdp else frozenset())
    cfg = MemProfilerCfg(enabled=True, save_dir=str(path), collect_funcs=funcs, track_fsdp_mem=fsdp)
    return MemProfiler(cfg, model, engine=ctx)


class _NoProfiler:
    def profile(self, fn: str, **kw):
        return contextlib.nullcontext()

    def close(self) -> list:
        return []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="ddp,ddp_ac_unused,fsdp2,fsdp2_ac,fsdp2_mp,fsdp2_head")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--emulate", choices=("", "check", "late"), default="",
                    help="run each mode on offload.testing's emulated accelerator (streams on CPU, every op "
                         "checked; late: side-stream work run late); the result records the hazards")
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", a.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend, init_method=a.init_method, rank=a.rank, world_size=a.world_size)
    result: dict = {"rank": a.rank, "world_size": a.world_size, "modes": {}, "error": None}
    try:
        for mode in a.modes.split(","):
            if device.type == "cuda":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.MATH):  # deterministic backward for bitwise checks
                    result["modes"][mode] = run_mode(mode, a.rank, a.world_size, device, a.steps, a.out)
            elif a.emulate:
                from offload.testing import EmulatedAccelerator

                with EmulatedAccelerator(late=a.emulate == "late") as acc:
                    result["modes"][mode] = run_mode(mode, a.rank, a.world_size, device, a.steps, a.out)
                result["modes"][mode]["emulator"] = acc.summary()
            else:
                result["modes"][mode] = run_mode(mode, a.rank, a.world_size, device, a.steps, a.out)
    except Exception:  # reported to the test through the JSON, with the traceback
        result["error"] = traceback.format_exc()
    (a.out / f"result_rank{a.rank}.json").write_text(json.dumps(result, indent=1, default=str))
    dist.destroy_process_group()
    return 1 if result["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
