"""DDP and FSDP2 under the engine, world size 2 on CPU (gloo), one process per rank.

The ranks run ``_dist_worker.py`` (one launch for all modes, to pay the
process start-up once) and report through JSON; each test below judges one
property. Rendezvous is a ``file://`` in tmp and gloo is bound to loopback,
so nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "_dist_worker.py"
MODES = ("ddp", "ddp_ac_unused", "fsdp2", "fsdp2_ac", "fsdp2_mp", "fsdp2_head")
STEPS = 3


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")  # two ranks share the two cores
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    return env


def launch_ranks(out: Path, world: int, *, backend: str = "gloo", device: str = "cpu",
                 modes=MODES, steps: int = STEPS, timeout_s: float = 240, emulate: str = "") -> list[dict]:
    """Start ``world`` worker processes, wait, and return each rank's result dict."""
    out.mkdir(parents=True, exist_ok=True)
    init = f"file://{out / 'rendezvous'}"
    procs = []
    for rank in range(world):
        cmd = [sys.executable, str(WORKER), "--rank", str(rank), "--world-size", str(world),
               "--init-method", init, "--backend", backend, "--device", device,
               "--modes", ",".join(modes), "--steps", str(steps), "--out", str(out), "--emulate", emulate]
        procs.append(subprocess.Popen(cmd, env=_env(), cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for rank, p in enumerate(procs):
        f = out / f"result_rank{rank}.json"
        assert f.exists(), f"rank {rank} wrote no result (exit {p.returncode}); log:\n{logs[rank][-4000:]}"
        r = json.loads(f.read_text())
        assert r["error"] is None, f"rank {rank} failed:\n{r['error']}\nlog:\n{logs[rank][-2000:]}"
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}; log:\n{logs[rank][-4000:]}"
        results.append(r)
    return results


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory) -> list[dict]:
    return launch_ranks(tmp_path_factory.mktemp("gloo_ws2"), 2)


pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_grads_bitwise_equal(gloo_results, mode):
    """On every rank, loss, every grad and the updated params equal the no-offload twin bitwise."""
    for r in gloo_results:
        m = r["modes"][mode]
        assert not m["loss_mismatch"], f"rank {r['rank']} {mode}: loss differs at steps {m['loss_mismatch']}"
        assert not m["grad_mismatch"], f"rank {r['rank']} {mode}: {m['grad_mismatch'][:5]}"
        assert not m["param_mismatch"], f"rank {r['rank']} {mode}: params differ {m['param_mismatch'][:5]}"
        assert m["summary"]["offloaded_count"] > 0, f"rank {r['rank']} {mode}: nothing was offloaded"
        if mode == "fsdp2_head":
            assert m["summary"]["kept_count_by_reason"].get("excluded_region", 0) > 0, m["summary"]


@pytest.mark.parametrize("mode", MODES)
def test_no_parameter_or_dtensor_offloaded(gloo_results, mode):
    """No DTensor, Parameter, or view of a (sharded or unsharded) parameter's storage is offloaded;
    the parameter views pack sees are kept with reason "parameter"."""
    for r in gloo_results:
        m = r["modes"][mode]
        assert not m["violations"], f"rank {r['rank']} {mode}: {m['violations'][:5]}"
        s = m["summary"]
        assert s["kept_count_by_reason"].get("parameter", 0) > 0, (
            f"rank {r['rank']} {mode}: no pack was kept as 'parameter' (kept: {s['kept_count_by_reason']})"
        )
        assert m["seen"]["param_kept"] == s["kept_count_by_reason"]["parameter"]
        if mode != "fsdp2_head":  # (given the model up front, its buffers are also kept as "parameter")
            assert m["seen"]["param_like_bytes"] == s["kept_by_reason"]["parameter"], (m["seen"], s["kept_by_reason"])
        assert s["packed_bytes"] == s["offloaded_bytes"] + s["kept_bytes"]


@pytest.mark.parametrize("mode", MODES)
def test_per_rank_ledgers(gloo_results, mode):
    """Each rank writes its own ledger JSON, with one closed step per backward."""
    paths = set()
    for r in gloo_results:
        m = r["modes"][mode]
        path = Path(m["ledger_path"])
        paths.add(path)
        assert path.exists() and path.stat().st_size > 0, path
        data = json.loads(path.read_text())
        assert isinstance(data, dict) and data, path
        assert m["summary"]["steps"] == STEPS, (r["rank"], mode, m["summary"]["steps"])
    assert len(paths) == 2


@pytest.mark.parametrize("mode", MODES)
def test_per_rank_memprofiler_files(gloo_results, mode):
    """Each rank's MemProfiler (running around the offloaded step) writes its own rank-named files
    and snapshots its collected call; for FSDP2 also the FSDPMemTracker report."""
    for r in gloo_results:
        m, rank = r["modes"][mode], r["rank"]
        names = {Path(f).name for f in m["profile_files"]}
        assert f"rank_{rank}_memory_stats.yaml" in names, (rank, mode, names)
        assert f"rank_{rank}_memory_summary.txt" in names, (rank, mode, names)
        if mode == "fsdp2":
            assert any(n.startswith(f"fsdp_mem_rank_{rank}_") for n in names), (rank, mode, names)
        assert f"{rank}.training_step.2.end" in m["profile_keys"], (rank, mode, m["profile_keys"])


def test_torchrun_example_cpu(tmp_path):
    """examples/torchrun_fsdp2.py runs under torchrun (2 ranks, gloo) and writes one ledger per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "examples" / "torchrun_fsdp2.py"), "--steps", "2", "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"torchrun exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    for rank in range(2):
        data = json.loads((tmp_path / f"ledger_rank{rank}.json").read_text())
        assert data, rank
    assert "rank 0" in p.stdout and "rank 1" in p.stdout, p.stdout


@pytest.mark.gpu
def test_fsdp2_one_gpu_nccl(tmp_path):
    """FSDP2 at world size 1 on nccl, real device offload: bitwise equal, no parameter offloaded."""
    modes = tuple(m for m in MODES if m.startswith("fsdp2"))
    (r,) = launch_ranks(tmp_path, 1, backend="nccl", device="cuda", modes=modes, steps=STEPS)
    for mode in modes:
        m = r["modes"][mode]
        assert not (m["loss_mismatch"] or m["grad_mismatch"] or m["param_mismatch"]), (mode, m)
        assert not m["violations"], (mode, m["violations"][:5])
        assert m["summary"]["offloaded_count"] > 0, mode
        assert m["summary"]["steps"] == STEPS, mode
        assert "0.training_step.2.end" in m["profile_keys"], (mode, m["profile_keys"])


@pytest.mark.emulated
@pytest.mark.parametrize("emulate", ["check", "late"])
def test_fsdp2_on_the_emulated_stream_path(tmp_path, emulate):
    """FSDP2 on two gloo ranks with the engine's side-stream path on offload.testing's emulator (every op
    checked; late: side-stream work run late): no hazard, loss and grads bitwise equal to the twin."""
    results = launch_ranks(tmp_path / emulate, 2, modes=("fsdp2",), steps=2, emulate=emulate)
    for r in results:
        m = r["modes"]["fsdp2"]
        assert m["emulator"]["hazards"] == 0, m["emulator"]["hazard_reports"]
        assert m["emulator"]["ops_checked"] > 1000
        assert not m["loss_mismatch"] and not m["grad_mismatch"] and not m["param_mismatch"], m
        assert m["summary"]["offloaded_count"] > 0


@pytest.mark.parametrize("units", ["layers", "mlps"])
def test_fsdp2_long_context_matches_the_plain_sharded_step(tmp_path, units):
    """offload.long_context on a tiny HF Llama under FSDP2 (each layer and the root fully_shard-ed; with
    "mlps" each tiled MLP is an FSDP unit of its own too), two gloo ranks: checkpointed blocks with offloaded
    inputs, the tiled MLP (one autograd node per call, so FSDP's gradient hooks fire once) and the tiled loss
    give every rank the plain sharded step's loss and gradients within fp32 rounding (the tiles reorder sums
    over tokens), two steps running."""
    pytest.importorskip("transformers")
    worker = HERE / "_dist_long_context_worker.py"
    init = f"file://{tmp_path / 'rendezvous'}"
    extra = ["mlps"] if units == "mlps" else []
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", init, str(tmp_path), *extra], env=_env(),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for rank in range(2):
        path = tmp_path / f"long_context_rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing; log:\n{logs[rank][-3000:]}"
        r = json.loads(path.read_text())
        assert r["error"] is None, r["error"]
        for a, b in zip(r["losses"]["plain"], r["losses"]["long_context"]):
            assert abs(a - b) <= 1e-5 * abs(a), (rank, r["losses"])
        assert r["worst_grad_rel"] <= 1e-5, (rank, r["worst_grad_rel"])
        assert r["mlp"]["calls"] == 4 and r["loss"]["calls"] == 2 and r["offloaded"] > 0, r
