"""The caching-allocator model: rounding as the allocator rounds, stream-ordered frees held until released,
the peak and what it holds (NOTE [ Device memory model ] in offload/predict/_memory.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload.predict._memory import MIN_BLOCK_BYTES, DeviceMemory, block_bytes, replay
from offload.predict._trace import Alloc, Free, HostSync, RecordStream, Trace


@given(st.integers(min_value=1, max_value=1 << 40))
def test_blocks_are_the_smallest_multiple_of_512_that_holds_the_request(n):
    """Every request takes the least multiple of 512 bytes at or above it."""
    b = block_bytes(n)
    assert b % MIN_BLOCK_BYTES == 0 and n <= b < n + MIN_BLOCK_BYTES


def test_an_empty_request_takes_no_block():
    """A zero-byte request allocates nothing (the allocator returns a null pointer)."""
    mem = DeviceMemory()
    assert mem.alloc(1, 0) == 0 and mem.allocated_bytes == 0


def test_peak_and_breakdown_sum_to_the_bytes_live_at_the_peak():
    """The breakdown at the peak sums to the peak, by category, and activations are counted by module."""
    mem = DeviceMemory()
    mem.alloc(1, 1000, category="parameter")
    mem.alloc(2, 3000, category="activation", module="m.layers.0")
    mem.alloc(3, 100, category="other")
    mem.free(3)
    mem.free(2)
    bd = mem.breakdown_at_peak()
    assert mem.peak_bytes == 1024 + 3072 + 512 == sum(v for k, v in bd.items() if k != "held")
    assert mem.activations_at_peak() == {"m.layers.0": 3072}
    assert mem.allocated_bytes == 1024


def test_a_block_freed_while_another_stream_uses_it_holds_memory_until_released():
    """A free held for stream order still counts in the peak until its release time, not in allocated."""
    mem = DeviceMemory()
    mem.alloc(1, 4096, category="activation", stream=0, now=0.0)
    mem.record_stream(1, 1)
    mem.free(1, now=1.0, release_at=5.0)
    assert mem.allocated_bytes == 0 and mem.in_use_bytes == 4096
    mem.alloc(2, 4096, now=2.0)  # cannot reuse the held block: both count
    assert mem.peak_bytes == 8192 and mem.peak_allocated_bytes == 4096
    assert mem.breakdown_at_peak()["held"] == 4096
    mem.advance(5.0)
    assert mem.in_use_bytes == 4096


def test_program_order_replay_holds_a_recorded_block_until_the_host_syncs_its_stream():
    """Without a clock, a block freed with a use on another stream is held until that stream is synchronized."""
    tr = Trace(items=[Alloc(1, 1 << 20, 0, "copy"), RecordStream(1, 1), Free(1),
                      Alloc(2, 1 << 20, 0, "other"), HostSync("stream", 1), Alloc(3, 1 << 20, 0, "other")])
    mem = replay(tr)
    assert mem.peak_bytes == 2 << 20
    tr_nosync = Trace(items=[Alloc(1, 1 << 20, 0, "copy"), Free(1), Alloc(2, 1 << 20, 0, "other")])
    assert replay(tr_nosync).peak_bytes == 1 << 20


def test_the_clock_never_goes_back():
    """A replay that moves the clock backwards is a bug in the caller: it raises."""
    mem = DeviceMemory()
    mem.advance(2.0)
    with pytest.raises(ValueError, match="went back"):
        mem.alloc(1, 10, now=1.0)
