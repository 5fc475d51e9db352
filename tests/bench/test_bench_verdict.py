"""Gradient verdicts (issue 36 item 3): with every kernel deterministic a difference is the strategy's;
where a kernel cannot be deterministic (flash-attention's dQ atomics on a GPU, stood in for here by an
attention whose backward adds run-to-run noise and raises torch's alert), each strategy is judged
against the reference's own run-to-run noise, and the verdict names which case it is."""

from __future__ import annotations

import itertools
import types
import warnings

import pytest
import torch

import bench.model
from bench.harness import BenchConfig, run_bench
from bench.results import Correctness
from bench.strategies import STRATEGIES, Prepared, StrategySpec
from bench.verdict import NOISE_FACTOR, Snapshot, compare, is_nondeterministic_alert
from bench.workloads import PRESETS

WL = PRESETS["tiny"].replace(dim=64, n_heads=1, n_layers=2, seq_len=16, vocab_size=64)
_DRAWS = itertools.count(1)


def _alert(name: str) -> None:
    """What torch does for a kernel without a deterministic implementation (same message)."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    msg = (f"{name} does not have a deterministic implementation, but you set "
           f"'torch.use_deterministic_algorithms(True{', warn_only=True' if warn_only else ''})'.")
    if not warn_only:
        raise RuntimeError(msg)
    warnings.warn(msg)


class _AtomicsLikeGrad(torch.autograd.Function):
    """Identity forward; backward adds a little noise that differs on every call (as atomics' summation
    order does) and alerts like a kernel without a deterministic mode."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _alert("flash_like_attention_backward")
        gen = torch.Generator().manual_seed(next(_DRAWS))
        return g + g.abs().mean() * 1e-4 * torch.randn(g.shape, generator=gen, dtype=g.dtype)


def _noisy_sdpa(q, k, v, **kwargs):
    return torch.nn.functional.scaled_dot_product_attention(_AtomicsLikeGrad.apply(q), k, v, **kwargs)


@pytest.fixture
def noisy_attention(monkeypatch):
    monkeypatch.setattr(bench.model, "F", types.SimpleNamespace(
        **{n: getattr(torch.nn.functional, n) for n in dir(torch.nn.functional) if not n.startswith("__")},
    ))
    monkeypatch.setattr(bench.model.F, "scaled_dot_product_attention", _noisy_sdpa)


def _corrupting():
    """A strategy that changes one gradient as a broken offload would (stale data in the embedding's grad)."""

    def prepare(env):
        base = STRATEGIES["none"].prepare(env).step

        def step():
            loss = base()
            env.model.tok_embeddings.weight.grad.mul_(1.01)
            return loss

        return Prepared(step=step)

    return StrategySpec(name="corrupt", description="changes a grad", prepare=prepare, group="control")


def _run(monkeypatch, names):
    monkeypatch.setitem(STRATEGIES, "corrupt", _corrupting())
    cfg = BenchConfig(workload=WL, strategies=names, steps=1, warmup=0, order="sequential", progress=False,
                      deterministic_check=True)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    result = run_bench(cfg, {"device": "cpu"})
    assert (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled()) == before  # the run restores the flags
    return {s.name: s for s in result.strategies}


def test_deterministic_kernels_give_bitwise_verdicts_that_catch_any_change(monkeypatch):
    """Every kernel deterministic (warn_only=False ran): engine strategies are bitwise equal, and a strategy
    that changes a gradient is reported as changing the numbers, not as noise."""
    by = _run(monkeypatch, ("none", "offload", "corrupt"))
    for name in ("none", "offload"):
        c = by[name].correctness
        assert c.mode == "bitwise" and c.bitwise_equal and c.verdict == "bitwise equal", (name, c)
    c = by["corrupt"].correctness
    assert c.mode == "bitwise" and not c.grads_equal
    assert c.verdict.startswith("DIFFERS with every kernel deterministic")


def test_a_nondeterministic_kernel_is_judged_against_the_noise_floor(monkeypatch, noisy_attention):
    """A kernel without a deterministic mode: none's two runs give the floor (and name the kernel); offload
    and AC land within it, a strategy that changes a gradient lands beyond it; each verdict says which."""
    by = _run(monkeypatch, ("none", "offload", "ac", "corrupt"))
    ref = by["none"].correctness
    assert ref.mode == "noise_floor" and ref.nondeterministic_ops == ["flash_like_attention_backward"]
    assert not ref.bitwise_equal and ref.noise_floor > 0  # the stand-in really is noisy run to run
    for name in ("offload", "ac"):
        c = by[name].correctness
        assert c.mode == "noise_floor" and c.within_noise is True, (name, c.verdict)
        assert not c.bitwise_equal and "within the noise" in c.verdict
        assert "flash_like_attention_backward" in c.verdict
    c = by["corrupt"].correctness
    assert c.within_noise is False and c.verdict.startswith("DIFFERS beyond the noise"), c.verdict
    assert c.worst_tensor == "grad 0"  # the embedding's gradient, the one it changed


def _snap(*values: float) -> Snapshot:
    return Snapshot(torch.tensor(values[0]), [torch.tensor([v]) for v in values[1:]])


def test_a_tensor_with_no_noise_must_match_bitwise():
    """A tensor the noisy kernel does not reach (floor 0) fails on any difference, however small."""
    ref, floor = _snap(1.0, 2.0, 3.0), _snap(1.0, 2.5, 3.0)
    ok = compare(ref, _snap(1.0, 2.9, 3.0), floor=floor, ops=["k"])
    assert ok.within_noise is True and ok.noise_floor == 0.5
    bad = compare(ref, _snap(1.0, 2.0, 3.0 + 1e-6), floor=floor, ops=["k"])
    assert bad.within_noise is False and bad.worst_tensor == "grad 1"
    far = compare(ref, _snap(1.0, 2.0 + 0.5 * NOISE_FACTOR + 0.1, 3.0), floor=floor, ops=["k"])
    assert far.within_noise is False


def test_without_a_noise_floor_the_verdict_is_inconclusive():
    """A strategy whose kernel is not deterministic, against a reference whose kernels all were: no
    floor to judge by, so neither pass nor fail."""
    c = compare(_snap(1.0, 2.0), _snap(1.0, 2.1), ops=["k"])
    assert c.within_noise is None and c.verdict.startswith("inconclusive") and "k has no deterministic" in c.verdict
    assert Correctness(True, True, 1, 0.0).verdict == "bitwise equal"


def test_only_torchs_determinism_alert_counts_as_a_nondeterministic_kernel():
    """Other errors (OOM, a real bug) are not mistaken for a kernel without a deterministic mode."""
    with pytest.raises(RuntimeError) as e:
        torch.use_deterministic_algorithms(True)
        try:
            _alert("index_add_cuda_")
        finally:
            torch.use_deterministic_algorithms(False)
    assert is_nondeterministic_alert(e.value)
    assert not is_nondeterministic_alert(RuntimeError("CUDA out of memory"))
