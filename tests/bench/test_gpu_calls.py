"""What the GPU run's bench phases rely on (issue 41, scripts/gpu_run.sh): the partial sweep's first-k strategies
offload exactly the first k blocks with gradients bitwise those of ``none``; the account-only control runs with each
pack hook; ``--trace`` keeps one profiled step per named strategy; ``--plan --strategies`` measures only the named
arms; and every results file records the GPU-trace callbacks and the host CPU it ran with."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch.overrides import TorchFunctionMode

import bench.env as bench_env
from bench import cli
from bench.harness import BenchConfig, run_bench
from bench.plan import FIXED_ARMS, frontier_arms
from bench.plan_models import PLAN_MODELS, build_target
from bench.strategies import FIRST_BLOCKS_SWEEP, STRATEGIES, first_blocks, part_blocks
from bench.workloads import PRESETS

WL = PRESETS["tiny"].replace(dim=32, n_heads=1, n_layers=3, seq_len=16, vocab_size=64)
MICRO = ["--dim", "32", "--layers", "3", "--seq", "16", "--batch", "2", "--vocab", "64", "--steps", "1",
         "--warmup", "0", "--quiet", "--no-probe", "--no-plot", "--device", "cpu", "--no-predict"]


def _offloaded_blocks(result, name: str) -> set[int]:
    mods = next(s for s in result.strategies if s.name == name).engine.module_offloaded_bytes
    return {int(m.group(1)) for name, b in mods.items() if b > 0 and (m := re.search(r"\blayers\.(\d+)", name))}


def test_first_k_and_account_only_strategies_do_what_they_name():
    """offload_first<k> (and offload_part, k = part_blocks) moves bytes of blocks 0..k-1 only (none at k = 0), caps
    k at the model's blocks; account_only_python / _native move nothing with the pack hook they name (the native
    one skipped with the build's reason where it cannot build); every gradient is bitwise that of none."""
    from offload import _native

    names = ("none", "offload_first0", "offload_first4", "offload_part", "account_only_python", "account_only_native")
    result = run_bench(BenchConfig(workload=WL, strategies=names, steps=1, warmup=0, order="sequential",
                                   progress=False), {"device": "cpu"})
    by = {s.name: s for s in result.strategies}
    native = _native.available()
    assert by["account_only_native"].status == ("ok" if native else "skipped"), by["account_only_native"].reason
    ran = [n for n in names[1:] if by[n].status == "ok"]
    assert set(names[1:]) - set(ran) <= {"account_only_native"}, {n: s.reason for n, s in by.items()}
    assert all(by[n].correctness.bitwise_equal for n in ran)
    assert _offloaded_blocks(result, "offload_first4") == {0, 1, 2}  # k = 4 > 3 blocks: all of them
    assert _offloaded_blocks(result, "offload_part") == set(range(part_blocks(3)))
    assert by["offload_first0"].engine.offloaded_bytes == 0 < by["offload_first0"].engine.packed_bytes
    assert by["account_only_python"].engine.offloaded_bytes == 0
    assert [first_blocks(f"offload_first{k}", 32)[0] for k in FIRST_BLOCKS_SWEEP] == list(FIRST_BLOCKS_SWEEP)
    assert first_blocks("offload", 32) is None and first_blocks("offload_firstx", 32) is None
    env = _env()
    assert STRATEGIES["account_only_python"].prepare(env).engine.config.native_hooks is False
    if native:
        assert STRATEGIES["account_only_native"].prepare(env).engine.config.native_hooks is True


def _env():
    import torch

    from bench.harness import build_model
    from bench.model import make_batch
    from bench.strategies import BenchEnv

    model = build_model(WL, torch.device("cpu"), 0)
    tokens, targets = make_batch(model.cfg, WL.batch, WL.seq_len, device="cpu", seed=0)
    return BenchEnv(model=model, tokens=tokens, targets=targets, device=torch.device("cpu"), engine_device="cpu")


def test_trace_keeps_one_profiled_step_per_named_strategy(tmp_path, capsys):
    """--trace writes the named strategies' chrome traces beside the results and summarises them there; a traced
    strategy's measured figures are those of an untraced run; tracing one that does not run is refused."""
    assert cli.main([*MICRO, "--strategies", "none,offload_part", "--trace", "offload_part", "--out",
                     str(tmp_path)]) == 0
    (data,) = [json.loads(p.read_text()) for p in tmp_path.glob("tiny_*.json")]
    by = {s["name"]: s for s in data["strategies"]}
    assert by["none"].get("trace") is None
    trace = by["offload_part"]["trace"]
    assert (tmp_path / trace["file"]).is_file() and trace["host"]["offload::pack"]["count"] > 0
    assert data["meta"]["gpu_trace_at_start"]["callbacks"] == 0 == data["meta"]["gpu_trace_at_end"]["callbacks"]
    assert "One profiled step" in next(tmp_path.glob("tiny_*.md")).read_text()
    capsys.readouterr()
    assert cli.main([*MICRO, "--strategies", "none", "--trace", "offload", "--no-write"]) == 2
    assert "--trace offload: ['offload'] not among the strategies run" in capsys.readouterr().err


def test_plan_strategies_name_the_frontiers_arms():
    """--plan --strategies measures exactly the named fixed arms (the ILP only when named); 'all' keeps every
    fixed arm and the ILP; an unknown arm is refused, naming it and the arms there are."""
    assert frontier_arms("all", "cpu") == (FIXED_ARMS, True)
    assert frontier_arms("none,ac,offload_ac", "cpu") == (("none", "ac", "offload_ac"), False)
    assert frontier_arms("ac,torch_ilp", "cpu") == (("ac",), True)
    with pytest.raises(ValueError, match=r"\['bogus'\] are not arms of the frontier.*offload_ac"):
        frontier_arms("none,bogus", "cpu")


def test_gpu_trace_state_counts_every_registered_callback():
    """gpu_trace_state counts a callback added to any of torch.cuda._gpu_trace's registries (and none after it is
    removed); the CPU record names the model, cores and load."""
    import torch.cuda._gpu_trace as gpu_trace

    before = bench_env.gpu_trace_state()
    assert before["registries_checked"] >= 10

    def callback(*args):
        pass

    gpu_trace.MemoryAllocationCallbacks.add_callback(callback)
    try:
        during = bench_env.gpu_trace_state()
    finally:
        gpu_trace.MemoryAllocationCallbacks.callback_list.remove(callback)
    assert during["callbacks"] == before["callbacks"] + 1 and "MemoryAllocationCallbacks" in during["registries"]
    assert bench_env.gpu_trace_state()["callbacks"] == before["callbacks"]
    cpu = bench_env.cpu_record()
    assert cpu["logical_cores"] > 0 and {"model", "mhz_now", "governor", "loadavg_1_5_15m"} <= set(cpu)


class _GeneratorOnItsDevice(TorchFunctionMode):
    """CUDA's rule on CPU: a random draw given a generator must draw on the generator's device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = kwargs.get("generator")
        if g is not None and torch.device(kwargs.get("device") or "cpu").type != g.device.type:
            raise RuntimeError(f"{func.__name__}: a {g.device.type} generator drawing on {kwargs['device']}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("model", PLAN_MODELS)
def test_plan_targets_build_on_a_device_other_than_the_generators(model):
    """The plan phase of the H200 run at 4358372 failed at once: build_target drew its inputs with a CPU generator
    inside ``torch.device("cuda")``. Every plan model builds under the same rule on another device (meta)."""
    if model.startswith("hf_"):
        pytest.importorskip("transformers")
    with _GeneratorOnItsDevice():
        target = build_target(model, WL, torch.device("meta"))
    assert next(target.model.parameters()).device.type == "meta"


def test_every_measured_step_records_the_hosts_issue_time(tmp_path):
    """Each measured step records the wall time until its Python returned (before the device synchronize): one per
    step, never above the step's own time, in the JSON and as the markdown table's "issue ms" column."""
    code = cli.main(MICRO + ["--strategies", "none,offload", "--steps", "2", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    for s in data["strategies"]:
        t = s["times"]
        assert len(t["issue_seconds"]) == len(t["seconds"]) == 2, s["name"]
        assert all(0 < i <= w for i, w in zip(t["issue_seconds"], t["seconds"])), s["name"]
    head = " ".join(next(line for line in next(tmp_path.glob("*.md")).read_text().splitlines()
                         if line.startswith("| strategy")).split())
    assert "| CPU ms | issue ms |" in head, head
