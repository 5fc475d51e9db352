"""offload.testing.EmulatedAccelerator on its own: stream semantics, the checker, frees, late data."""

from __future__ import annotations

import threading

import pytest
import torch

from offload import OffloadActivations, streams
from offload.testing import EmulatedAccelerator, HazardError

pytestmark = pytest.mark.emulated


def _kinds(acc):
    return [h.kind for h in acc.hazards]


def test_current_stream_is_live_and_thread_local():
    """current_stream() changes inside stream(s) and is per thread, as torch.cuda's is."""
    with EmulatedAccelerator() as acc:
        s = acc.Stream()
        assert acc.current_stream() is acc.default_stream()
        seen = []
        with acc.stream(s):
            assert acc.current_stream() is s
            t = threading.Thread(target=lambda: seen.append(acc.current_stream()))
            t.start()
            t.join()
        assert acc.current_stream() is acc.default_stream()
        assert seen == [acc.default_stream()]
        assert s != acc.default_stream() and s == s
        assert isinstance(s, torch.Stream)  # so tensor.record_stream(s) reaches the emulator


def test_unordered_write_then_read_is_reported_with_both_sides():
    """A side-stream read of a tensor written on the default stream with no wait is a hazard naming both
    streams, both ops and both Python stacks; the same code with wait_stream is clean."""

    def producer(x):
        return x * 2.0

    def consumer_on_side(acc, side, h, wait):
        if wait:
            side.wait_stream(acc.current_stream())
        with acc.stream(side):
            return h.sin()

    for wait in (False, True):
        with EmulatedAccelerator() as acc:
            side = acc.Stream()
            h = producer(torch.randn(64))
            out = consumer_on_side(acc, side, h, wait)
            acc.current_stream().wait_stream(side)
            out.sum().item()
        if wait:
            acc.assert_no_hazards()
            continue
        assert _kinds(acc) == ["unordered access"], [str(h) for h in acc.hazards]
        hz = acc.hazards[0]
        assert hz.streams == ("stream1", "default") and hz.ops == ("aten::sin", "aten::mul")
        text = str(hz)
        assert "consumer_on_side" in text and "producer" in text  # both stacks
        assert "stack of the later access" in text and "stack of the earlier access" in text
        with pytest.raises(HazardError, match="1 stream-ordering hazard"):
            acc.assert_no_hazards()


def test_event_wait_orders_and_a_stale_event_does_not():
    """wait_event orders what the event covers, and only that: a write issued after the record is unordered."""
    with EmulatedAccelerator() as acc:
        side = acc.Stream()
        a = torch.zeros(16)
        b = torch.zeros(16)
        side.wait_stream(acc.current_stream())
        with acc.stream(side):
            a.fill_(1.0)
            ev = acc.Event()
            ev.record()
            b.fill_(2.0)  # after the event
        acc.current_stream().wait_event(ev)
        a.add_(1.0)  # ordered
        b.add_(1.0)  # not ordered
    assert [h.ops for h in acc.hazards] == [("aten::add_", "aten::fill_")]


def test_synchronize_orders_everything():
    with EmulatedAccelerator() as acc:
        side = acc.Stream()
        a = torch.zeros(16)
        side.wait_stream(acc.current_stream())
        with acc.stream(side):
            a.fill_(1.0)
        side.synchronize()
        a.add_(1.0)
        side.wait_stream(acc.current_stream())
        with acc.stream(side):
            a.fill_(3.0)
        acc.synchronize()
        a.add_(1.0)
    acc.assert_no_hazards()
    assert torch.equal(a, torch.full((16,), 4.0))


def test_free_while_side_read_queued_is_reported_and_record_stream_or_wait_cover_it():
    """The deletion race (torchtune #1867): a storage allocated on the default stream, read on a side stream,
    then freed with no order is a hazard; record_stream(side) or a wait of the default stream covers it."""
    for fix in (None, "record_stream", "wait"):
        with EmulatedAccelerator() as acc:
            side = acc.Stream()
            src = torch.randn(256) * 1.0  # allocated on the default stream
            dst = torch.empty(256)
            side.wait_stream(acc.current_stream())
            with acc.stream(side):
                dst.copy_(src)
            if fix == "record_stream":
                src.record_stream(side)
            elif fix == "wait":
                acc.current_stream().wait_stream(side)
            del src  # the last reference: the allocator may reuse the block now
            acc.current_stream().wait_stream(side)
        if fix:
            acc.assert_no_hazards()
        else:
            assert _kinds(acc) == ["free before access"]
            hz = acc.hazards[0]
            assert hz.streams == ("default", "stream1") and hz.ops == ("free", "aten::copy_")
            assert "test_free_while_side_read_queued" in str(hz)


def test_tensor_allocated_on_side_stream_freed_from_compute_is_reported():
    """Rule 4: a block allocated on the side stream and read on compute goes back to the side stream's pool
    when freed; without record_stream(compute) that is a hazard."""
    for fix in (False, True):
        with EmulatedAccelerator() as acc:
            side = acc.Stream()
            with acc.stream(side):
                dev = torch.ones(128) * 3.0
                ev = acc.Event()
                ev.record()
            acc.current_stream().wait_event(ev)
            y = dev + 1.0
            if fix:
                dev.record_stream(acc.current_stream())
            del dev
            assert y.sum().item() == 4.0 * 128
        if fix:
            acc.assert_no_hazards()
        else:
            assert _kinds(acc) == ["free before access"]


def test_late_mode_runs_side_work_only_when_ordered():
    """late=True: a side-stream copy is not visible to the default stream before a wait reaches it; then it is."""
    with EmulatedAccelerator(late=True, check=False) as acc:
        side = acc.Stream()
        src = torch.arange(8.0)
        dst = torch.zeros(8)
        with acc.stream(side):
            dst.copy_(src)
            clone = src * 1.0  # a new tensor made on the side stream: poison until it runs
            ev = acc.Event()
            ev.record()
        assert torch.equal(dst, torch.zeros(8))
        assert torch.isnan(clone).all()
        assert not ev.query() and not ev.query()  # lag=2 polls
        acc.current_stream().wait_event(ev)
        assert torch.equal(dst, src) and torch.equal(clone, src)


def test_late_mode_query_after_lag_and_synchronize_run_the_work():
    with EmulatedAccelerator(late=True, lag=1, check=False) as acc:
        side = acc.Stream()
        dst = torch.zeros(4)
        with acc.stream(side):
            dst.fill_(5.0)
            ev = acc.Event()
            ev.record()
            dst.fill_(6.0)
        assert not ev.query()
        assert ev.query() and torch.equal(dst, torch.full((4,), 5.0))
        assert not side.query()
        side.synchronize()
        assert torch.equal(dst, torch.full((4,), 6.0))


def test_late_mode_random_schedule_is_seeded():
    """seed=: queued work runs at random points; the same seed gives the same schedule."""

    def run(seed):
        with EmulatedAccelerator(late=True, seed=seed, check=False) as acc:
            side = acc.Stream()
            dst = torch.zeros(64)
            seen = []
            for i in range(64):
                with acc.stream(side):
                    dst[i].fill_(1.0)
                x = torch.ones(4) * 2  # default-stream ops: random points to run queued work
                seen.append(int(dst.sum().item() > 0) + int(x.sum().item()))
            return seen

    assert run(1) == run(1)
    assert run(1) != run(2) or run(3) != run(1)


def test_parked_stream_runs_late_until_host_reads():
    """_sleep (torch.cuda._sleep's stand-in) parks the current stream: its ops queue until something needs them."""
    with EmulatedAccelerator(late=True, check=False) as acc:
        a = torch.zeros(4)
        acc._sleep(10**8)
        a.add_(1.0)
        assert a.sum().item() == 4.0  # the host reads (.item()): the stream runs first
        acc._sleep(10**8)
        b = a * 2
        side = acc.Stream()
        with acc.stream(side):
            c = torch.empty(4)
            c.copy_(b)  # unordered: reads b's poison
            side.synchronize()
        assert torch.isnan(c).all()
        assert torch.equal(b, torch.full((4,), 2.0))


def test_engine_gets_the_emulator_only_inside_it():
    """The injection seam: engines built inside `with acc` use the emulated side stream; nothing is left
    registered afterwards and torch.cuda is never touched."""
    cuda_current = torch.cuda.current_stream
    with EmulatedAccelerator() as acc:
        ctx = OffloadActivations(device="cpu", min_offload_size=0)
        assert ctx.backend == "stream" and ctx._backend._mod is acc
        assert OffloadActivations(device="cpu", use_streams=False).backend == "sync"
    assert streams._DEVICE_MODULES == []
    assert OffloadActivations(device="cpu").backend == "sync"
    assert torch.cuda.current_stream is cuda_current


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="late="):
        EmulatedAccelerator(late="yes")
    with pytest.raises(ValueError, match="lag="):
        EmulatedAccelerator(lag=-1)


def test_raise_on_hazard_raises_at_the_op():
    with EmulatedAccelerator(raise_on_hazard=True) as acc:
        side = acc.Stream()
        a = torch.ones(4) * 2
        with acc.stream(side), pytest.raises(HazardError, match="aten::mul"):
            a.add_(1.0)


_GATE = {"started": threading.Event(), "release": threading.Event()}


@torch.library.custom_op("offload_testing::gated_fill", mutates_args=("x",))
def _gated_fill(x: torch.Tensor, value: float) -> None:
    """A slow kernel: fills ``x`` only once the test opens the gate."""
    _GATE["started"].set()
    assert _GATE["release"].wait(30), "the test never opened the gate"
    x.fill_(value)


def test_a_stream_runs_its_ops_in_order_when_two_host_threads_wait_on_it():
    """A stream is FIFO across host threads: while one thread runs a queued op, another thread waiting
    for a later event waits for that op too; it never runs the next op early or sees the event done
    before the op's bytes are written (two threads sharing one engine got poison gradients from this)."""
    _GATE["started"].clear()
    _GATE["release"].clear()
    seen = {}
    with EmulatedAccelerator(late=True, check=False) as acc:
        side = acc.Stream()
        x, y = torch.zeros(4), torch.zeros(4)
        with acc.stream(side):
            torch.ops.offload_testing.gated_fill(x, 1.0)
            y.copy_(x)  # queued behind the slow fill: must read its result
            ev = acc.Event()
            ev.record()

        def wait(name):
            with acc:
                ev.synchronize()
            seen[name] = (x.tolist(), y.tolist())

        first = threading.Thread(target=wait, args=("first",))
        first.start()
        assert _GATE["started"].wait(30)  # the first thread is inside the slow op
        second = threading.Thread(target=wait, args=("second",))
        second.start()
        second.join(0.5)
        blocked = second.is_alive()
        _GATE["release"].set()
        first.join(30)
        second.join(30)
    assert blocked, f"the second thread's synchronize returned while the op before its event was running: {seen}"
    assert seen["first"] == seen["second"] == ([1.0] * 4, [1.0] * 4), seen


@pytest.mark.parametrize("second", ["read", "write"])
def test_overlapping_host_views_conflict_wherever_they_start(second):
    """Host memory is checked per byte range: a view written on one stream and an overlapping view that
    starts at another byte, read (or written) on a second stream with no wait, is a hazard; views of
    disjoint bytes of the same buffer (the pool's buffers carved from one chunk) are not."""
    for overlap in (True, False):
        with EmulatedAccelerator() as acc:
            d2h, h2d = acc.Stream(), acc.Stream()
            host = torch.zeros(256)
            acc._host_memory(host)  # what the engine's backend says of its host buffers
            src = torch.randn(128)
            d2h.wait_stream(acc.current_stream())
            h2d.wait_stream(acc.current_stream())
            with acc.stream(d2h):
                host[:128].copy_(src)  # bytes [0, 512)
            other = host[64:192] if overlap else host[128:256]  # starts at byte 256 (or 512)
            with acc.stream(h2d):
                if second == "read":
                    other.mul(2.0)
                else:
                    other.fill_(1.0)
            acc.synchronize()
        if overlap:
            assert _kinds(acc) == ["unordered access"], [str(h) for h in acc.hazards]
            assert acc.hazards[0].streams == ("stream2", "stream1")
        else:
            acc.assert_no_hazards()


def test_a_view_over_several_host_ranges_is_one_hazard():
    """A host view that spans ranges cut by earlier views conflicts once per earlier access, named by
    the buffer's storage."""
    with EmulatedAccelerator() as acc:
        d2h, h2d = acc.Stream(), acc.Stream()
        host = torch.zeros(256)
        acc._host_memory(host)
        d2h.wait_stream(acc.current_stream())
        h2d.wait_stream(acc.current_stream())
        with acc.stream(d2h):
            host[:128].copy_(torch.randn(128))
            host[32:64].mul(1.0)  # same stream: ordered, but cuts the buffer into more ranges
        with acc.stream(h2d):
            host[:128].mul(2.0)
        acc.synchronize()
    assert _kinds(acc) == ["unordered access"], [str(h) for h in acc.hazards]
    assert acc.hazards[0].data_ptr == host.untyped_storage().data_ptr()
