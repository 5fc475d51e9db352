"""The bench harness at a micro size: files written, numbers present, numerics bitwise equal to `none`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import cli
from bench.harness import BenchConfig, cpu_activation_peak, run_bench
from bench.hardware import PCIE_GEN5_X16_GB_S, peak_for
from bench.probe import measure_ceiling, run_probe
from bench.results import BenchResult, Ceiling, EngineStats, StepTimes, StrategyResult, median_ci
from bench.strategies import STRATEGIES
from bench.targets import TARGETS, evaluate_targets, judge_ratio
from bench.workloads import PRESETS

MICRO = ["--dim", "64", "--layers", "2", "--seq", "32", "--batch", "2", "--vocab", "128",
         "--steps", "2", "--warmup", "1", "--quiet", "--no-probe"]
CPU_RUNNABLE = ["none", "ac", "sac", "offload", "offload_sync", "offload_ac", "offload_head_excluded",
                "account_only", "save_on_cpu"]
GPU_ONLY = ["trl", "torchtune", "compile", "compile_offload"]


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    assert cli.main(MICRO + ["--device", "cpu", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the bench's 1-thread default does not leak
    (json_path,) = out.glob("*.json")
    return out, json.loads(json_path.read_text())


def test_micro_run_writes_json_markdown_png(micro_run):
    """One run writes <run_id>.json, .md and .png into --out."""
    out, data = micro_run
    stem = data["workload"]["run_id"]
    assert stem == "tiny_L2_s32_b2_float32"
    assert {p.name for p in out.iterdir()} == {f"{stem}.json", f"{stem}.md", f"{stem}.png"}
    md = (out / f"{stem}.md").read_text()
    assert "python -m bench" in md and "Performance targets (defined in `bench/targets.py`)" in md


def test_micro_run_every_cpu_strategy_is_bitwise_equal_to_none(micro_run):
    """Every CPU-runnable strategy ran, timed its steps and matched `none` bitwise (loss and all grads)."""
    _, data = micro_run
    by = {s["name"]: s for s in data["strategies"]}
    for name in CPU_RUNNABLE:
        s = by[name]
        assert s["status"] == "ok", (name, s["reason"])
        assert len(s["times"]["seconds"]) == 2
        assert s["median_s"] > 0 and s["tokens_per_s"] > 0
        assert s["activation_bytes"] > 0, name
        c = s["correctness"]  # `none` is checked against its own first step: it must repeat
        assert c["loss_equal"] and c["grads_equal"], (name, c)
        assert c["grads_compared"] > 0 and c["against"] == "none"


def test_micro_run_records_skip_reasons_for_gpu_only_peers(micro_run):
    """GPU-only peers are skipped on CPU with a recorded reason, not silently dropped."""
    _, data = micro_run
    by = {s["name"]: s for s in data["strategies"]}
    for name in GPU_ONLY:
        assert by[name]["status"] == "skipped"
        assert "CPU" in by[name]["reason"] or "GPU" in by[name]["reason"]


def test_micro_run_engine_accounting(micro_run):
    """Ours report ledger numbers; the accounting-only control moves nothing; AC offloads less than no AC."""
    _, data = micro_run
    by = {s["name"]: s for s in data["strategies"]}
    off, ctrl, off_ac = by["offload"]["engine"], by["account_only"]["engine"], by["offload_ac"]["engine"]
    assert off["offloaded_bytes"] > 0 and off["packed_bytes"] >= off["offloaded_bytes"]
    assert off["pool_allocations_after_warmup"] == 0
    assert ctrl["offloaded_bytes"] == 0 and ctrl["packed_bytes"] == off["packed_bytes"]
    assert 0 < off_ac["offloaded_bytes"] < off["offloaded_bytes"]
    assert by["offload_head_excluded"]["engine"]["kept_by_reason"].get("excluded_region", 0) > 0
    assert by["none"]["engine"] is None


def test_micro_run_counts_every_arms_host_copies_alike(micro_run):
    """On CPU every arm's host copies count in its activation memory and its host bytes, measured one way.

    The pool is emptied before the profiled step, so ours allocates its buffers there as save_on_cpu
    allocates its copies: both arms' activation peaks hold their host copies (at the end of the forward
    all of them are alive), and the host bytes come from allocator events inside each arm's pack hook,
    not from the pool's counters.
    """
    _, data = micro_run
    by = {s["name"]: s for s in data["strategies"] if s["status"] == "ok"}
    assert by["ac"]["activation_bytes"] < by["none"]["activation_bytes"]
    for name in ("none", "ac", "sac"):
        assert by[name]["host_copy_bytes"] == 0, name  # no pack hook: nothing copied
    for name in ("offload", "offload_sync", "offload_head_excluded", "offload_ac", "save_on_cpu"):
        s = by[name]
        assert s["host_copy_bytes"] > 0, name
        # (0.9: frees of memory allocated before the profiled step offset the running sum a little)
        assert s["activation_bytes"] >= 0.9 * s["host_copy_bytes"], (name, s["activation_bytes"],
                                                                      s["host_copy_bytes"])
    off = by["offload"]["engine"]
    # The host footprint is read from the pool's allocations (not its counters) after a step that re-grew
    # it from empty: a static loop holds at most 1.05x the bytes the ledger says one step holds.
    assert off["held_bytes_last_step"] > 0 and off["host_bytes_measured"] >= off["held_bytes_last_step"]
    assert off["host_footprint_ratio"] <= 1.05, off
    assert by["account_only"]["host_copy_bytes"] == 0  # its pack hook runs but moves nothing
    # Every measured step is timed in wall clock and in process CPU time.
    assert all(len(s["times"]["cpu_seconds"]) == len(s["times"]["seconds"]) == 2 for s in by.values())


def test_micro_run_targets_cover_design(micro_run):
    """The report judges every target of bench/targets.py; PCIe and GPU ones read n/a on CPU, the CPU ones get a
    verdict."""
    _, data = micro_run
    verdicts = [t["verdict"] for t in data["targets"]]
    assert len(verdicts) == len(TARGETS) == 7
    assert verdicts[:4] == ["n/a on CPU"] * 4
    assert verdicts[4] in ("PASS", "FAIL")
    assert verdicts[5] == "n/a on CPU"
    assert verdicts[6].split(" (")[0] in ("PASS", "FAIL", "inconclusive")
    assert all(t["source"] == "bench/targets.py" for t in data["targets"])


def test_sequential_order_runs_one_strategy_at_a_time():
    """The GPU defaults (sequential order, pools released, correctness from an extra deterministic step) on CPU."""
    wl = PRESETS["tiny"].replace(dim=64, n_heads=1, n_layers=1, seq_len=16, vocab_size=64)
    cfg = BenchConfig(workload=wl, strategies=("offload_ac", "none", "offload"), steps=2, warmup=1,
                      order="sequential", progress=False, deterministic_check=True)
    result = run_bench(cfg, {"device": "cpu"})
    assert [s.name for s in result.strategies] == ["none", "offload_ac", "offload"]  # none moved first
    assert result.get("none").correctness.bitwise_equal  # the reference repeats
    for name in ("offload_ac", "offload"):
        s = result.get(name)
        assert s.ok and s.correctness.bitwise_equal and s.correctness.against == "none"
        assert s.engine.pool_reserved_bytes > 0
    assert result.meta["order"] == "sequential"


def test_compiled_strategies_compare_with_compile():
    """compile_offload is judged against compile (compiled kernels round differently from eager)."""
    order = list(STRATEGIES)
    assert STRATEGIES["compile_offload"].reference == "compile"
    assert order.index("compile") < order.index("compile_offload")
    assert all(spec.reference == "none" for n, spec in STRATEGIES.items() if n != "compile_offload")


def test_step_times_properties():
    """Median, quartiles and spread are derived from the raw step times."""
    t = StepTimes([4.0, 1.0, 3.0, 2.0])
    assert t.median_s == 2.5 and t.min_s == 1.0 and t.max_s == 4.0
    assert t.p25_s == pytest.approx(1.75) and t.p75_s == pytest.approx(3.25) and t.iqr_s == pytest.approx(1.5)
    assert math.isnan(StepTimes().median_s)


def test_time_ratio_pairs_rounds_when_interleaved():
    """Interleaved runs compare step i with step i (load drift cancels); sequential runs compare medians."""
    a = StrategyResult(name="a", description="", status="ok", times=StepTimes([1.0, 2.0, 4.0]))
    b = StrategyResult(name="b", description="", status="ok", times=StepTimes([1.0, 1.0, 4.0]))
    inter = BenchResult(meta={"order": "interleaved"}, workload={}, ceiling=None, strategies=[a, b])
    seq = BenchResult(meta={"order": "sequential"}, workload={}, ceiling=None, strategies=[a, b])
    assert inter.time_ratio("a", "b") == 1.0  # median of (1, 2, 1)
    assert seq.time_ratio("a", "b") == 2.0  # 2.0 / 1.0


def _fake_result(device: str, **ratios: float) -> BenchResult:
    def s(name: str, seconds: float, act: int, engine: EngineStats | None = None) -> StrategyResult:
        return StrategyResult(name=name, description="", status="ok", tokens_per_step=10,
                              times=StepTimes([seconds] * 8, [seconds] * 8), activation_bytes=act, engine=engine)

    def eng(moved: float) -> EngineStats:
        return EngineStats(steps=1, packed_bytes=100, offloaded_bytes=90, kept_bytes=10, kept_by_reason={},
                           d2h_bytes=moved, d2h_seconds=moved / 50e9, h2d_bytes=moved, h2d_seconds=moved / 45e9,
                           stall_seconds=0, peak_inflight_bytes=0, pool_reserved_bytes=100,
                           pool_peak_reserved_bytes=100, pool_peak_in_use_bytes=100, pool_allocations_total=5,
                           pool_allocations_after_warmup=0, pool_pin_failures=0, held_bytes_last_step=100,
                           host_bytes_measured=100)
    # offload: 2 x 24.96 GB over 52 GB/s = 0.96 s of link; offload_part copies 200 B and cuts 190 (95%).
    strategies = [s("none", 1.0, 1000), s("ac", 1.3, 200), s("offload", ratios.get("offload", 1.02), 500, eng(24.96e9)),
                  s("offload_ac", ratios.get("offload_ac", 1.31), 150, eng(100)),
                  s("offload_part", ratios.get("offload_part", 1.01), ratios.get("part_act", 810), eng(200)),
                  s("account_only", 1.01, 1000, eng(0))]
    return BenchResult(meta={"device": device}, workload={"dim": 4096, "seq_len": 4096}, strategies=strategies,
                       ceiling=Ceiling(kind="pinned", d2h_gb_s=52.0, h2d_gb_s=52.0, size_bytes=1))


def test_targets_verdicts_on_gpu_shapes():
    """On a GPU result of the target shape, each target gets PASS/FAIL from the side-by-side ratios."""
    rows = evaluate_targets(_fake_result("cuda:0"))
    assert [r.verdict for r in rows] == ["PASS", "PASS", "PASS", "FAIL", "PASS", "PASS", "PASS"]  # H2D 45/52 < 90%
    assert evaluate_targets(_fake_result("cuda:0", offload=1.10))[2].verdict == "FAIL"  # 1.146x the link
    assert evaluate_targets(_fake_result("cuda:0", offload_part=1.05))[1].verdict == "FAIL"  # slower than 1.03x
    assert evaluate_targets(_fake_result("cuda:0", part_act=900))[1].verdict == "FAIL"  # cut 50% of its copies


def test_targets_use_host_bytes_measured_outside_the_pool():
    """The host-footprint target divides bytes measured outside the pool by the ledger's bytes held:
    a pinned allocator that rounds 100 B up to 128 B fails it even though the pool's counters say 1.0."""
    result = _fake_result("cuda:0")
    eng = result.get("offload").engine
    eng.held_bytes_last_step = eng.host_bytes_measured = 100
    assert eng.pool_counter_ratio == 1.0
    eng.host_bytes_measured = 128
    assert evaluate_targets(result)[4].verdict == "FAIL"
    eng.host_bytes_measured = None
    assert evaluate_targets(result)[4].verdict == "not run"


def test_median_ci_and_noise_aware_verdicts():
    """A ratio whose 95% interval straddles the threshold is inconclusive, with the noise, not FAIL."""
    assert median_ci(list(range(20))) == (5, 14)  # order statistics 6 and 15 of 20
    assert median_ci([1.0] * 5) is None  # too few for 95%
    assert judge_ratio(1.02, (1.00, 1.025), 1.03) == "PASS"
    assert judge_ratio(1.08, (1.05, 1.10), 1.03) == "FAIL"
    assert judge_ratio(1.04, (1.00, 1.08), 1.03) == "inconclusive (noise ±3.8%)"
    assert judge_ratio(1.04, None, 1.03).startswith("FAIL (no spread")


def test_time_ratio_ci_from_paired_cpu_times():
    """Interleaved runs give the median of paired ratios and its interval, in wall or CPU time."""
    a = StrategyResult(name="a", description="", status="ok",
                       times=StepTimes([2.0] * 10, [1.0 + 0.01 * i for i in range(10)]))
    b = StrategyResult(name="b", description="", status="ok", times=StepTimes([1.0] * 10, [1.0] * 10))
    r = BenchResult(meta={"order": "interleaved"}, workload={}, ceiling=None, strategies=[a, b])
    assert r.time_ratio("a", "b") == 2.0
    assert r.time_ratio("a", "b", "cpu") == pytest.approx(1.045)
    lo, hi = r.time_ratio_ci("a", "b", "cpu")
    assert lo == pytest.approx(1.01) and hi == pytest.approx(1.08)


def test_targets_na_on_cpu():
    """The PCIe targets read n/a on CPU whatever the ratios."""
    rows = evaluate_targets(_fake_result("cpu"))
    assert [r.verdict for r in rows[:4]] == ["n/a on CPU"] * 4


def test_config_rejects_unknown_strategy():
    """A typo in --strategies names the bad value and the known ones."""
    with pytest.raises(ValueError, match="unknown strategies.*nope.*none"):
        BenchConfig(workload=PRESETS["tiny"], strategies=("none", "nope"))
    assert cli.main(["--strategies", "none,nope", "--quiet", "--no-write"]) == 2


def test_list_prints_presets_and_strategies(capsys):
    """--list names every preset and every strategy."""
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in list(PRESETS) + list(STRATEGIES):
        assert name in out


def test_presets_are_valid_and_sized():
    """GPU presets have the issue's widths; the 8b preset fits layers to memory."""
    assert (PRESETS["1b"].dim, PRESETS["1b"].n_layers) == (2048, 16)
    assert PRESETS["3b"].dim == 3072 and PRESETS["8b"].dim == 4096 and PRESETS["8b"].fit_layers
    assert all(PRESETS[p].dtype == "bfloat16" for p in ("1b", "3b", "8b"))
    assert 0.9e9 < PRESETS["1b"].param_count() < 1.5e9


def test_hardware_peaks_have_sources():
    """Datasheet peaks are looked up by device name and carry a source."""
    assert peak_for("NVIDIA H100 80GB HBM3").bf16_dense_tflops == 989.0
    assert peak_for("NVIDIA H200").hbm_tb_s == 4.8 and "datasheet" in peak_for("NVIDIA H200").source
    assert peak_for("cpu") is None
    assert PCIE_GEN5_X16_GB_S == pytest.approx(63.0, abs=0.1)


def test_probe_on_cpu_reports_memcpy_and_says_pinned_na():
    """On CPU the probe measures memcpy and states that pinned memory is n/a."""
    r = run_probe("cpu", (1, 2))
    assert [p.direction for p in r.points] == ["memcpy", "memcpy"] and all(p.gb_s > 0 for p in r.points)
    assert r.pinned_d2h_gb_s is None and any("pinned: n/a" in n for n in r.notes)
    c = measure_ceiling("cpu")
    assert c.kind == "memcpy" and c.d2h_gb_s > 0


def test_cpu_activation_peak_counts_saved_tensors():
    """The profiler-based CPU activation measure sees a step's saved tensors."""
    w = torch.randn(256, 256, requires_grad=True)

    def step():
        h = torch.randn(512, 256)
        for _ in range(4):
            h = torch.tanh(h @ w)  # saves (512, 256) float32 = 512 KiB per layer
        h.sum().backward()

    assert cpu_activation_peak(step) >= 4 * 512 * 256 * 4


@pytest.mark.gpu
def test_gpu_micro_run_bitwise_and_device_memory(tmp_path):
    """On a GPU, ours and the peers that load run bitwise equal to `none`, with device memory measured."""
    cfg = BenchConfig(
        workload=PRESETS["tiny"].replace(dim=256, n_layers=2, seq_len=256, batch=2, dtype="bfloat16"),
        strategies=("none", "ac", "offload", "offload_sync", "offload_ac", "offload_head_excluded", "save_on_cpu"),
        device="cuda", steps=2, warmup=1, order="sequential", progress=False,
    )
    result = run_bench(cfg, {"device": "cuda"}, measure_ceiling("cuda"))
    for s in result.strategies:
        assert s.ok, (s.name, s.reason)
        assert s.peak_allocated_bytes and s.activation_bytes is not None
        assert s.correctness.bitwise_equal, (s.name, s.correctness)  # deterministic-mode step
    off = result.get("offload")
    assert off.engine.d2h_gb_s and off.engine.h2d_gb_s
    assert result.activation_ratio("offload", "none") < 1.0


@pytest.mark.gpu
def test_gpu_probe_pinned_beats_pageable():
    """The GPU probe measures pinned and pageable copies, alone and under a matmul."""
    r = run_probe("cuda", (16,))
    assert r.pinned_d2h_gb_s and r.pinned_h2d_gb_s and r.best("h2d", "pageable")
    assert r.best("d2h", "pinned", under_matmul=True) and r.matmul_tflops_alone


def test_cpu_main_job_ends_with_a_labelled_h100_prediction(micro_run):
    """The CPU main job's JSON and markdown carry a PREDICTED-on-H100 row per engine-free and engine strategy."""
    out, data = micro_run
    pred = data["meta"]["predicted_on_h100"]
    assert pred["kind"] == "predicted" and "PREDICTED on h100-sxm" in pred["title"]
    assert [r["strategy"] for r in pred["rows"]] == ["none", "ac", "offload", "offload_ac"]
    assert all(r["kind"] == "predicted" and r["peak_bytes"] > 0 for r in pred["rows"])
    md = (out / f"{data['workload']['run_id']}.md").read_text()
    assert "PREDICTED on h100-sxm" in md
