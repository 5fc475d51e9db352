"""MemProfiler on plain CPU loops: schedule, keys, hook values, dumps, engine totals, bad config."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import yaml
from torch import nn

from offload import OffloadActivations
from offload.profiling import (
    MemProfiler,
    MemProfilerCfg,
    MemProfilerFuncs,
    MemProfilerHooks,
    MemProfilerSchedule,
    memprofilable,
)

from _prof_models import MLP


def _loop(prof: MemProfiler, model: nn.Module, n: int, fn: str = "training_step", x=None) -> None:
    x = MLP.batch() if x is None else x
    for _ in range(n):
        with prof.profile(fn):
            model(x).sum().backward()


def _hooks_on(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_default_schedule_yaml(tmp_path, mlp):
    """Default schedule: call 2 collected; safe-loadable YAML with rss/vms and exact npp hook values."""
    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path), mlp)
    _loop(prof, mlp, 3)
    data = yaml.safe_load((tmp_path / "rank_0_memory_stats.yaml").read_text())
    assert set(data) == {"0.training_step.2.start", "0.training_step.2.end"}
    start, end = data["0.training_step.2.start"], data["0.training_step.2.end"]
    for entry in (start, end):
        assert entry["rss"] > 0 and entry["vms"] >= entry["rss"]
        assert entry["rss_pre_forward"] > 0 and entry["rss_post_forward"] > 0
    # start: nothing has run in this call yet (the warm-up call's values did not leak in)
    assert start["npp_pre_forward"] == start["npp_post_forward"] == start["npp_diff"] == 0
    assert start["rss_diff"] == 0
    # end: the root module's forward, exactly the hand-computed saved bytes
    assert end["npp_pre_forward"] == 0
    assert end["npp_post_forward"] == end["npp_diff"] == MLP.LOGICAL
    assert end["npp_unique_diff"] == MLP.UNIQUE
    assert end["packed.logical_bytes"] == MLP.LOGICAL
    assert end["packed.packed_bytes"] == MLP.LOGICAL + MLP.STATIC
    mods = end["modules"]
    assert {k: v["npp_diff"] for k, v in mods.items()} == {"MLP": MLP.LOGICAL, **MLP.PER_MODULE_LOGICAL}
    assert (tmp_path / "rank_0_memory_summary.txt").read_text().count("0.training_step.2.") == 2
    # window closed after call 2: hooks are gone
    assert _hooks_on(mlp) == 0 and not prof.hooks_installed


def test_pickle_matches_yaml_and_longer_schedule(tmp_path, mlp):
    """warmup_iters=2, max_iter=4 collects calls 3 and 4; the pickle holds the same plain data."""
    cfg = MemProfilerCfg(enabled=True, save_dir=tmp_path, dump_memorystats_pickle=True,
                         schedule=MemProfilerSchedule(warmup_iters=2, max_iter=4))
    prof = MemProfiler(cfg, mlp)
    _loop(prof, mlp, 6)
    with open(tmp_path / "rank_0_memory_stats.pickle", "rb") as f:
        pk = pickle.load(f)
    ym = yaml.safe_load((tmp_path / "rank_0_memory_stats.yaml").read_text())
    assert pk == ym
    assert sorted(pk) == sorted(f"0.training_step.{i}.{c}" for i in (3, 4) for c in ("start", "end"))
    assert all(pk[f"0.training_step.{i}.end"]["npp_diff"] == MLP.LOGICAL for i in (3, 4))
    assert type(pk) is dict


def test_values_come_from_children_when_root_does_not_run(tmp_path, mlp):
    """A wrapper whose own forward never runs (as in Lightning harnesses) still gets non-zero values."""

    class Harness(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

    h = Harness(mlp)
    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path), h)
    _loop(prof, h.model, 2)
    end = prof.memory_stats["0.training_step.2.end"]
    assert end["npp_diff"] == MLP.LOGICAL
    assert "Harness.model" in end["modules"]  # its FQN in the profiled model, as the engine names it


def test_hooks_only_during_collected_calls(tmp_path, mlp):
    """Hooks are on only inside collected calls, even when a retained function never runs (issue 9, item 7)."""
    cfg = MemProfilerCfg(
        enabled=True, save_dir=tmp_path,
        collect_funcs=MemProfilerFuncs(cpu={"validation_step"}),
        schedule=MemProfilerSchedule(warmup_iters=0, max_iter=1),
        retain_hooks_for_funcs={"training_step", "validation_step"},
    )
    prof = MemProfiler(cfg, mlp)
    _loop(prof, mlp, 1, "training_step")
    assert prof.done == {"training_step"} and _hooks_on(mlp) == 0  # the seed kept them until validation_step
    _loop(prof, mlp, 1, "validation_step")
    assert prof.done == {"training_step", "validation_step"} and _hooks_on(mlp) == 0
    assert set(prof.memory_stats) == {
        "0.training_step.1.start", "0.training_step.1.end",
        "0.validation_step.1.start", "0.validation_step.1.end",
    }


def test_unprofiled_calls_do_not_leak(tmp_path, mlp):
    """A big un-profiled forward between collected calls does not show up in the next entries."""
    cfg = MemProfilerCfg(enabled=True, save_dir=tmp_path, schedule=MemProfilerSchedule(warmup_iters=0, max_iter=2))
    prof = MemProfiler(cfg, mlp)
    _loop(prof, mlp, 1)
    big = torch.randn(64, 8)
    mlp(big).sum().backward()  # hooks still installed: an un-profiled call
    _loop(prof, mlp, 1)
    s2, e2 = prof.memory_stats["0.training_step.2.start"], prof.memory_stats["0.training_step.2.end"]
    assert s2["npp_diff"] == 0 and s2["rss_diff"] == 0
    assert e2["npp_diff"] == MLP.LOGICAL


def test_memprofilable_decorator(tmp_path, mlp):
    """@memprofilable profiles a method through self.memprofiler; None disables it."""

    class Harness:
        def __init__(self, prof):
            self.memprofiler = prof
            self.model = mlp

        @memprofilable
        def training_step(self, x):
            loss = self.model(x).sum()
            loss.backward()
            return loss

        @MemProfiler.memprofilable(name="training_step")
        def other_name(self, x):
            return self.model(x).sum()

    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path), mlp)
    h = Harness(prof)
    x = MLP.batch()
    h.training_step(x)
    h.other_name(x)  # counted as call 2 of training_step
    assert prof.memory_stats["0.training_step.2.end"]["npp_diff"] == MLP.LOGICAL
    assert isinstance(Harness(None).training_step(x), torch.Tensor)


def test_disabled_is_a_no_op(tmp_path, mlp):
    """enabled=False: no files, no hooks, no stats."""
    prof = MemProfiler(MemProfilerCfg(enabled=False, save_dir=tmp_path / "x"), mlp)
    _loop(prof, mlp, 3)
    assert not prof and prof.memory_stats == {} and prof.dump_memory_stats() == []
    assert not (tmp_path / "x").exists() and _hooks_on(mlp) == 0


def test_engine_totals_in_snapshots(tmp_path, toy):
    """With an offload engine, npp is counted through it, offloading continues, and entries carry its totals."""
    model, tokens, _ = toy
    engine = OffloadActivations(device="cpu")
    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path), model, engine=engine)
    for _ in range(2):
        with prof.profile("training_step"):
            with engine:
                logits = model(tokens)
                loss = logits.pow(2).mean()  # outside the model: pow saves the logits
            loss.backward()
    end = yaml.safe_load((tmp_path / "rank_0_memory_stats.yaml").read_text())["0.training_step.2.end"]
    last = engine.ledger.step_totals[-1]
    # offload.*: this call's own figures (issue 9, item 3); totals since creation under offload_cumulative.*
    assert end["offload.offloaded_bytes"] == last.offloaded_bytes > 0
    assert end["offload.packed_bytes"] == last.packed_bytes
    assert end["offload.kept_by_reason.parameter"] == last.kept_by_reason["parameter"]
    assert end["offload_cumulative.offloaded_bytes"] == engine.ledger.summary()["offloaded_bytes"]
    assert end["offload_cumulative.steps"] == 2 and "offload.steps" not in end
    assert end["packed.offloaded_bytes"] == last.offloaded_bytes
    assert end["packed.packed_bytes"] == last.packed_bytes
    assert end["packed.logical_bytes"] == last.packed_bytes - last.kept_by_reason.get("parameter", 0)
    assert end["npp_diff"] == end["packed.logical_bytes"] - logits.numel() * logits.element_size() > 0


def test_engine_observed_without_attach(tmp_path, toy):
    """Without attach_engine the engine seen in the pack stream is used (engine entered outside the call)."""
    model, tokens, _ = toy
    engine = OffloadActivations(device="cpu")
    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path, schedule=MemProfilerSchedule(warmup_iters=0)),
                       model)
    with engine:
        with prof.profile("training_step"):
            loss = model(tokens).float().mean()
    loss.backward()
    end = prof.memory_stats["0.training_step.1.end"]
    assert end["offload.offloaded_bytes"] > 0
    assert end["packed.packed_bytes"] == engine.ledger.summary()["packed_bytes"]


def test_user_saved_tensors_funcs_chain_and_skip_under_engine(tmp_path, mlp):
    """User (pack, unpack) run behind the counter; under an active engine they are skipped with a warning."""
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    cfg = MemProfilerCfg(enabled=True, save_dir=tmp_path, saved_tensors_funcs=(pack, "identity"),
                         schedule=MemProfilerSchedule(warmup_iters=0, max_iter=2))
    prof = MemProfiler(cfg, mlp)
    _loop(prof, mlp, 1)
    assert len(seen) == 4 and prof.memory_stats["0.training_step.1.end"]["npp_diff"] == MLP.LOGICAL
    with OffloadActivations(device="cpu"):
        with pytest.warns(UserWarning, match="would shadow the engine"):
            with prof.profile("training_step"):
                out = mlp(MLP.batch())
    out.sum().backward()
    assert len(seen) == 4
    assert prof.memory_stats["0.training_step.2.end"]["npp_diff"] == MLP.LOGICAL


def test_custom_hooks_and_attrs(tmp_path, mlp):
    """Custom hooks by callable write their own attributes into the snapshot."""

    def count_calls(ctx):
        ctx.add("calls", 1)

    cfg = MemProfilerCfg(
        enabled=True, save_dir=tmp_path,
        memory_hooks=MemProfilerHooks(pre_forward_hooks=[count_calls], post_forward_hooks=[],
                                      reset_state_hooks=["offload.profiling.hooks.reset_memory_hooks_state"]),
        save_hook_attrs=["calls"],
    )
    prof = MemProfiler(cfg, mlp)
    _loop(prof, mlp, 2)
    end = prof.memory_stats["0.training_step.2.end"]
    assert end["calls"] == 1  # only the outermost call adds to the totals
    assert end["modules"]["MLP.1"]["calls"] == 1
    assert "npp_diff" not in end


def test_plot_and_close(tmp_path, mlp):
    """dump_plot writes a PNG; close() removes hooks and writes pending stats."""
    cfg = MemProfilerCfg(enabled=True, save_dir=tmp_path, dump_plot=True, dump_when_done=False,
                         schedule=MemProfilerSchedule(warmup_iters=0, max_iter=3))
    prof = MemProfiler(cfg, mlp)
    _loop(prof, mlp, 2)
    assert not (tmp_path / "rank_0_memory_stats.yaml").exists() and _hooks_on(mlp) == 0
    written = prof.close()
    assert _hooks_on(mlp) == 0
    for name in ("rank_0_memory_stats.png", "rank_0_module_bytes.png"):
        png = tmp_path / name
        assert png in written and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(yaml.safe_load((tmp_path / "rank_0_memory_stats.yaml").read_text())) == 4


def test_rank_in_keys_and_names(tmp_path, mlp, monkeypatch):
    """The rank (from $RANK without a process group) prefixes keys and file names."""
    monkeypatch.setenv("RANK", "3")
    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path), mlp)
    _loop(prof, mlp, 2)
    assert set(prof.memory_stats) == {"3.training_step.2.start", "3.training_step.2.end"}
    assert (tmp_path / "rank_3_memory_stats.yaml").exists()


# ----------------------------------------------------------------- configuration
def test_bad_schedule():
    """max_iter at or below warmup_iters, or a negative warm-up, is refused with the fix."""
    with pytest.raises(ValueError, match=r"max_iter=1 is not above warmup_iters=2"):
        MemProfilerSchedule(warmup_iters=2, max_iter=1)
    with pytest.raises(ValueError, match="warmup_iters=-1"):
        MemProfilerSchedule(warmup_iters=-1)


def test_unknown_function_names():
    """Unresolvable hook/saved-tensor function paths and unknown retain names name the field."""
    with pytest.raises(ValueError, match=r"memory_hooks.pre_forward_hooks.*no_such_module"):
        MemProfilerCfg(enabled=True, memory_hooks=MemProfilerHooks(pre_forward_hooks=["no_such_module.fn"]))
    with pytest.raises(ValueError, match=r"'offload.profiling.hooks.nope' names no callable: .*has no attribute 'nope'"):
        MemProfilerCfg(enabled=True, memory_hooks=MemProfilerHooks(post_forward_hooks=["offload.profiling.hooks.nope"]))
    with pytest.raises(ValueError, match=r"saved_tensors_funcs\[0\]"):
        MemProfilerCfg(enabled=True, saved_tensors_funcs=("not_a_path", "identity"))
    with pytest.raises(ValueError, match=r"retain_hooks_for_funcs: unknown function names \['eval_step'\]"):
        MemProfilerCfg(enabled=True, retain_hooks_for_funcs={"eval_step"})


def test_unwritable_save_dir(tmp_path, mlp):
    """A save_dir that cannot be created or written is reported at construction, naming the field."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"MemProfilerCfg.save_dir=.*a_file/sub.*not a writable directory"):
        MemProfiler(MemProfilerCfg(enabled=True, save_dir=blocker / "sub"), mlp)


def test_cuda_requests_on_cpu_warn_and_clear():
    """On a CPU host, explicitly asked-for CUDA collection warns and is cleared (after merging defaults)."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = MemProfilerCfg(enabled=True)  # defaults alone: no warning
    assert quiet.collect_funcs.cuda == frozenset() and quiet.collect_funcs.cpu == {"training_step"}
    with pytest.warns(UserWarning, match="CUDA is not available"):
        cfg = MemProfilerCfg(enabled=True, cuda_allocator_history=True,
                             collect_funcs=MemProfilerFuncs(cuda={"training_step"}))
    assert cfg.collect_funcs.cuda == frozenset() and cfg.collect_funcs.cuda_allocator_history == frozenset()
    assert cfg.cuda_allocator_history is False


def test_cfg_from_dict_and_to_dict():
    """Configs round-trip through plain data (YAML sections); unknown fields are refused."""
    cfg = MemProfilerCfg.from_dict({"enabled": True, "schedule": {"warmup_iters": 2, "max_iter": 3},
                                    "collect_funcs": {"default": ["training_step", "validation_step"]}})
    assert cfg.schedule.max_iter == 3 and cfg.collect_funcs.cpu == {"training_step", "validation_step"}
    d = cfg.to_dict()
    assert yaml.safe_load(yaml.safe_dump(d))["schedule"] == {"warmup_iters": 2, "max_iter": 3}
    with pytest.raises(ValueError, match=r"unknown fields \['enable'\]"):
        MemProfilerCfg.from_dict({"enable": True})


def test_fsdp_root_must_be_fully_sharded(tmp_path, mlp):
    """track_fsdp_mem needs a fully_shard root that exists under the model."""
    with pytest.raises(ValueError, match="without fully_shard applied"):
        MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path, track_fsdp_mem=True), mlp)
    with pytest.raises(ValueError, match="no such submodule"):
        MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path, track_fsdp_mem=True,
                                   fsdp_mem_tracker_root_module="nope"), mlp)


# ------------------------------------------------------- issue 9: windows, rank, FTS, plots
def test_short_loop_still_writes(tmp_path, mlp):
    """max_iter never reached: each collected call is written as it ends, hooks are off between calls."""
    cfg = MemProfilerCfg(enabled=True, save_dir=tmp_path, schedule=MemProfilerSchedule(warmup_iters=0, max_iter=5))
    prof = MemProfiler(cfg, mlp)
    _loop(prof, mlp, 2)  # no close()
    data = yaml.safe_load((tmp_path / "rank_0_memory_stats.yaml").read_text())
    assert sorted(data) == sorted(f"0.training_step.{i}.{c}" for i in (1, 2) for c in ("start", "end"))
    assert data["0.training_step.2.end"]["npp_diff"] == MLP.LOGICAL
    assert _hooks_on(mlp) == 0 and prof.done == frozenset()


def test_written_at_interpreter_exit(tmp_path):
    """dump_when_done=False and no close(): the atexit handler writes what was collected."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = (
        "import torch\n"
        "from offload.profiling import MemProfiler, MemProfilerCfg\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        f"p = MemProfiler(MemProfilerCfg(enabled=True, save_dir={str(tmp_path)!r}, dump_when_done=False,\n"
        "                 schedule={'warmup_iters': 0, 'max_iter': 3}), m)\n"
        "with p.profile('training_step'):\n"
        "    m(torch.randn(2, 4)).sum().backward()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = yaml.safe_load((tmp_path / "rank_0_memory_stats.yaml").read_text())
    assert set(data) == {"0.training_step.1.start", "0.training_step.1.end"}


@pytest.mark.parametrize("env,rank", [({"SLURM_PROCID": "5"}, 5), ({"LOCAL_RANK": "2"}, 2),
                                      ({"OMPI_COMM_WORLD_RANK": "7", "LOCAL_RANK": "1"}, 7),
                                      ({"RANK": "3", "SLURM_PROCID": "9"}, 3)])
def test_rank_from_launcher_variables(tmp_path, mlp, monkeypatch, env, rank):
    """Without a process group the rank comes from torchrun/SLURM/MPI variables, so ranks do not share files."""
    for v in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "JSM_NAMESPACE_RANK", "LOCAL_RANK",
              "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        monkeypatch.delenv(v, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path), mlp)
    _loop(prof, mlp, 2)
    assert (tmp_path / f"rank_{rank}_memory_stats.yaml").exists()


FTS_YAML = """
enabled: true
retain_hooks_for_funcs: [training_step]
collect_funcs:
  default: [training_step]
memory_hooks:
  pre_forward_hooks: [fts_examples.profiling.npp_hooks._hook_npp_pre_forward]
  post_forward_hooks: [fts_examples.profiling.npp_hooks._hook_npp_post_forward]
  reset_state_hooks: [fts_examples.profiling.npp_hooks._reset_memory_hooks_state]
saved_tensors_funcs: [fts_examples.profiling.npp_hooks._npp_hook, identity_lambda]
"""


def test_fts_yaml_config_loads_and_collects(tmp_path, mlp):
    """An FTS YAML naming FTS's hook functions builds (FTS not installed) and yields the same npp values."""
    cfg = MemProfilerCfg.from_dict({**yaml.safe_load(FTS_YAML), "save_dir": str(tmp_path)})
    prof = MemProfiler(cfg, mlp)
    _loop(prof, mlp, 2)
    end = prof.memory_stats["0.training_step.2.end"]
    assert end["npp_diff"] == MLP.LOGICAL and end["rss_post_forward"] > 0


def _fts_pre(module, *args, **kwargs):  # written the FTS way: module attributes and mem_info_handle
    module.my_rss_pre = module.mem_info_handle().rss


def _fts_post(module, *args, **kwargs):
    module.my_calls = (module.my_calls if hasattr(module, "my_calls") else 0) + 1
    module.my_rss_post = module.mem_info_handle().rss


def _fts_reset(model, reset_attrs):
    for module in model.modules():
        for attr in reset_attrs:
            setattr(module, attr, 0)


def test_fts_style_hooks_run_through_the_adapter(tmp_path, mlp):
    """hook(module, *args) hooks work (they crashed on HookContext.mem_info_handle) and store nothing on modules."""
    before = {n: set(vars(m)) for n, m in mlp.named_modules()}
    cfg = MemProfilerCfg(
        enabled=True, save_dir=tmp_path, save_hook_attrs=["my_rss_pre", "my_rss_post", "my_calls"],
        memory_hooks=MemProfilerHooks(pre_forward_hooks=[_fts_pre], post_forward_hooks=[_fts_post],
                                      reset_state_hooks=[_fts_reset]),
    )
    prof = MemProfiler(cfg, mlp)
    _loop(prof, mlp, 2)
    end = prof.memory_stats["0.training_step.2.end"]
    assert end["my_calls"] == 1 and end["my_rss_post"] > 0 and end["my_rss_pre"] > 0
    assert end["modules"]["MLP.1"]["my_calls"] == 1
    assert {n: set(vars(m)) for n, m in mlp.named_modules()} == before


def test_plot_data_per_collected_call(tmp_path, toy):
    """The per-call stacked bars hold params, grads, activations kept and offloaded (= the engine's step)."""
    model, tokens, _ = toy
    engine = OffloadActivations(device="cpu")
    cfg = MemProfilerCfg(enabled=True, save_dir=tmp_path, dump_plot=True,
                         schedule=MemProfilerSchedule(warmup_iters=0, max_iter=2))
    prof = MemProfiler(cfg, model, engine=engine)
    for _ in range(2):
        with prof.profile("training_step"):
            with engine:
                loss = model(tokens).float().mean()
            loss.backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert [w["label"] for w in prof.windows] == ["training_step.1", "training_step.2"]
    for w, st in zip(prof.windows, engine.ledger.step_totals):
        assert w["params_bytes"] == w["grads_bytes"] == params
        assert w["activations_offloaded_bytes"] == st.offloaded_bytes > 0
        assert w["activations_kept_bytes"] == st.packed_bytes - st.kept_by_reason.get("parameter", 0) - st.offloaded_bytes
        mods = w["modules"]
        assert sum(m["offloaded_bytes"] for m in mods.values()) == st.offloaded_bytes
    assert (tmp_path / "rank_0_memory_stats.png").exists() and (tmp_path / "rank_0_module_bytes.png").exists()
