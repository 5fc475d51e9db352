"""Microbenchmarks of the engine's hot paths (pytest-benchmark).

CI runs each once (pyproject sets --benchmark-disable). For timings:
    pytest tests/bench/test_bench_micro.py --benchmark-enable
"""

from __future__ import annotations

import pytest
import torch

from offload import HostPool, Ledger, OffloadActivations, PackRecord

SHAPE = (256, 256)  # 256 KiB of float32: a small activation, where per-tensor overhead shows


@pytest.fixture(autouse=True)
def _one_thread():
    # Per-tensor overhead is what these measure. With 2 intra-op threads on a shared, busy machine a
    # 256 KiB copy waits on a descheduled worker thread (median ~20 ms vs ~80 us with one thread).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine() -> OffloadActivations:
    return OffloadActivations(device="cpu", min_offload_size=0)


def test_pack_per_tensor(benchmark):
    """Pack one tensor into the host pool (policy, pool take, copy, ledger record; handle release included)."""
    engine = _engine()
    t = torch.randn(SHAPE)
    engine.pack_hook(t)  # first pack allocates the pool buffer; the benchmark measures reuse

    benchmark(engine.pack_hook, t)
    s = engine.ledger.summary()
    assert s["offloaded_count"] >= 2 and s["pool"]["allocations"] == 1


def test_unpack_per_tensor(benchmark):
    """Unpack one offloaded tensor (copy back from the pool, rebuild size/stride)."""
    t = torch.randn(SHAPE)
    expected = t.clone()

    def setup():
        engine = _engine()
        return (engine, engine.pack_hook(t)), {}

    def unpack(engine, handle):
        return engine.unpack_hook(handle)

    out = benchmark.pedantic(unpack, setup=setup, rounds=200, iterations=1)
    assert torch.equal(out, expected) and out.stride() == t.stride()


def test_pool_take_and_give(benchmark):
    """Take a buffer of a size seen before and give it back (the steady-state path)."""
    pool = HostPool(pin=False)
    pool.give(pool.take(1 << 20))

    def take_give():
        pool.give(pool.take(1 << 20))

    benchmark(take_give)
    st = pool.stats()
    assert st["allocations"] == 1 and st["reuses"] >= 1 and st["in_use_bytes"] == 0


def test_ledger_record(benchmark):
    """Add one decision record to the ledger (totals, ring buffer, unique-storage set)."""
    ledger = Ledger(max_records=1000)
    rec = PackRecord(seq=0, step=0, nbytes=1 << 18, shape=SHAPE, dtype="torch.float32", device="cpu",
                     module="ToyLlama.layers.0.mlp", decision="offloaded", reason="", storage_key=1,
                     storage_nbytes=1 << 18, copy_bytes=1 << 18)

    benchmark(ledger.add, rec, True)
    s = ledger.summary()
    assert s["packed_count"] >= 1 and s["packed_count"] == s["offloaded_count"]
    assert len(ledger.records) <= 1000
