"""world_size=N: one rank of FSDP2, predicted on a fake process group (NOTE [ One FSDP2 rank ])."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from offload.predict import PredictError, max_context, predict_step
from offload.predict._capture import capture

from predict_testkit import adamw, toy

N_LAYERS = 4


def _padding_bytes(model_fn, world_size: int) -> int:
    """Bytes FSDP2 adds to rank 0's shards at most: dim 0 padded to a multiple of ``world_size``."""
    out = 0
    for p in model_fn().parameters():
        rows = p.shape[0] if p.dim() else 1
        padded = -(-rows // world_size) * world_size
        out += (padded - rows) * (p.numel() // max(rows, 1)) * p.element_size()
    return out


@pytest.fixture(scope="module")
def by_world_size() -> dict:
    model_fn, step_fn = toy(n_layers=N_LAYERS)
    return {n: predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", optimizer=adamw, world_size=n)
            for n in (1, 2, 4)}


@pytest.mark.parametrize("n", [2, 4])
def test_model_state_per_rank_is_the_unsharded_state_over_n(by_world_size, n):
    """Parameter, gradient and optimizer bytes per rank are the single-GPU ones / N, up to FSDP2's dim-0 padding."""
    one, rank = by_world_size[1].state_bytes, by_world_size[n].state_bytes
    model_fn = toy(n_layers=N_LAYERS)[0]
    pad = _padding_bytes(model_fn, n) // n
    steps = 4 * (1 - 1 / n) * len(list(model_fn().parameters()))  # AdamW's step counters: one float per parameter,
    for kind, slack in (("parameter", pad), ("gradient", pad), ("optimizer", 2 * pad + steps)):  # not sharded
        assert one[kind] > 0, kind
        assert one[kind] / n <= rank[kind] <= one[kind] / n + slack, (kind, one[kind], n, rank[kind])
    assert rank["buffer"] == one["buffer"]  # buffers are replicated


def test_peak_per_rank_falls_with_n_and_holds_a_block_unsharded(by_world_size):
    """The predicted peak per rank decreases with N, and stays above the sharded state plus one block's
    unsharded parameters (what FSDP2 all-gathers around a block)."""
    peaks = [by_world_size[n].peak_bytes for n in (1, 2, 4)]
    assert peaks[0] > peaks[1] > peaks[2], peaks
    model = toy(n_layers=N_LAYERS)[0]()
    block = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    for n in (2, 4):
        p = by_world_size[n]
        assert p.peak_bytes >= sum(p.state_bytes.values()) + block, (n, p.peak_bytes, p.state_bytes, block)
        assert p.breakdown_at_peak["parameter"] >= p.state_bytes["parameter"] + block
        assert p.world_size == n and f"over {n} GPUs" in repr(p) and any("FSDP2" in a for a in p.assumptions)


def test_blocks_are_resharded_after_use(by_world_size):
    """FSDP2 frees a block's unsharded parameters after its forward and backward (by resizing their storages):
    at the peak at most the root and two blocks (the current one and the prefetched next) are unsharded,
    not all of them."""
    model = toy(n_layers=N_LAYERS)[0]()
    block = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    root = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("layers."))
    for n in (2, 4):
        p = by_world_size[n]
        unsharded = p.breakdown_at_peak["parameter"] - p.state_bytes["parameter"] - p.state_bytes["buffer"]
        assert root + block <= unsharded <= root + 2.5 * block < root + N_LAYERS * block, (n, unsharded, root, block)


def test_world_size_1_is_the_single_gpu_prediction_exactly(by_world_size):
    """world_size=1 gives the single-GPU prediction item for item (trace, peak, breakdown, JSON)."""
    model_fn, step_fn = toy(n_layers=N_LAYERS)
    single = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", optimizer=adamw)
    one = by_world_size[1]
    assert one.trace.items == single.trace.items
    drop = {"capture_seconds"}
    assert {k: v for k, v in one.to_dict().items() if k not in drop} == \
        {k: v for k, v in single.to_dict().items() if k not in drop}
    assert not any("FSDP2" in a for a in one.assumptions)


@pytest.mark.parametrize("strategy", ["offload", "offload_ac"])
def test_sharding_leaves_the_engines_decisions_alone(strategy):
    """The engine sees the same activations under FSDP2: its decisions at world_size=2 equal those at 1,
    record for record (the unsharded weights it sees are parameters either way)."""
    model_fn, step_fn = toy(n_layers=2)
    one = capture(model_fn, step_fn, strategy=strategy, optimizer=adamw)
    two = capture(model_fn, step_fn, strategy=strategy, optimizer=adamw, world_size=2)
    assert one.records and one.records == two.records
    assert one.ledger_summary == two.ledger_summary


def test_no_process_group_is_left_after_a_prediction_returns_or_raises():
    """The fake process group is destroyed, and storage resizes and FSDP2 unpatched, whether the step
    returns or raises; a second prediction then starts clean."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    before = (torch.UntypedStorage.resize_, FSDPParamGroup.unshard, FSDPParamGroup.post_backward)
    model_fn, step_fn = toy(n_layers=2)
    predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", world_size=2)
    assert not dist.is_initialized()

    def broken(model):
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        predict_step(model_fn, broken, gpu="h100-sxm", strategy="none", world_size=2)
    assert not dist.is_initialized()
    assert (torch.UntypedStorage.resize_, FSDPParamGroup.unshard, FSDPParamGroup.post_backward) == before


def test_a_process_group_already_initialised_is_refused():
    """Inside a user's own process group a sharded prediction refuses (naming world_size) and leaves it as it was."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model_fn, step_fn = toy(n_layers=2)
        with pytest.raises(PredictError, match="world_size=2.*already initialised"):
            predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="none", world_size=2)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_world_size_is_refused_with_its_value(bad):
    """world_size must be an int >= 1; the error names the value."""
    model_fn, step_fn = toy(n_layers=2)
    with pytest.raises(ValueError, match=f"world_size={bad!r}"):
        predict_step(model_fn, step_fn, gpu="h100-sxm", world_size=bad)


def test_max_context_per_rank_grows_with_n():
    """Sharding frees memory for activations: the longest context per rank at N=2 is at least that at N=1."""
    import torch.nn.functional as F

    from bench.model import ToyLlama, ToyLlamaConfig
    from offload.predict import GPUS

    cfg = ToyLlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=4096)

    def step(model, seq):
        tokens = torch.randint(0, 128, (1, seq))
        return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

    single = predict_step(lambda: ToyLlama(cfg), lambda m: step(m, 128), gpu="h100-sxm", strategy="none",
                          optimizer=adamw)
    gpu = dataclasses.replace(GPUS["h100-sxm"], memory_bytes=single.peak_bytes + (4 << 20), reserve_bytes=0)
    kw = dict(gpu=gpu, strategy="none", optimizer=adamw, start=256, multiple=128, limit=4096)
    one, two = (max_context(lambda: ToyLlama(cfg), step, world_size=n, **kw) for n in (1, 2))
    assert 128 <= one <= two, (one, two)
