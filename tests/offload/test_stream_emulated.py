"""The side-stream backend's bookkeeping, run on CPU against emulated streams.

CI has no GPU, so the real ``torch.cuda`` stream/event objects are replaced by
fakes that log every ordering call and report copies as still in flight for
a few polls. The copies themselves run synchronously, so gradients must stay
bitwise exact, and the log lets us check the ordering rules of
NOTE [ Offload lifetime rules ] (Rules 2, 3 and 4) on every code path the GPU
takes: stash bounds, release ordering, source reuse, prefetch, stalls.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from bench.model import ToyLlama, ToyLlamaConfig, make_batch
from offload import OffloadActivations
from offload.streams import StreamBackend


class _Log(list):
    pass


class FakeEvent:
    lag = 2  # polls before an event reports done: copies look "in flight"

    def __init__(self, enable_timing: bool = False, *, log: _Log) -> None:
        self.log = log
        self.polls = 0
        self.stream = None

    def record(self, stream) -> None:
        self.stream = stream
        self.log.append(("record", stream.name, id(self)))

    def query(self) -> bool:
        self.polls += 1
        return self.polls > self.lag

    def synchronize(self) -> None:
        self.polls = self.lag + 1

    def elapsed_time(self, other: "FakeEvent") -> float:
        return 0.25


class FakeStream:
    def __init__(self, name: str, log: _Log) -> None:
        self.name = name
        self.log = log

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, ev: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, id(ev)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class FakeDeviceModule:
    """Just the surface StreamBackend uses of torch.cuda."""

    def __init__(self) -> None:
        self.log = _Log()
        self.current = FakeStream("compute", self.log)
        self.created = 0

    def Stream(self, device=None) -> FakeStream:  # noqa: N802 (mirrors torch.cuda.Stream)
        self.created += 1
        return FakeStream(f"side{self.created}", self.log)

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802
        return FakeEvent(enable_timing, log=self.log)

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev


def _emulated_engine(**kw) -> tuple[OffloadActivations, FakeDeviceModule, dict]:
    ctx = OffloadActivations(device="cpu", min_offload_size=0, **kw)
    fake = FakeDeviceModule()
    backend = StreamBackend(torch.device("cpu"))
    backend._mod = fake
    ctx._backend = backend
    seen: dict[str, list] = {"d2h": [], "h2d": [], "alloc_streams": []}
    d2h, h2d = backend.d2h, backend.h2d

    def spy_d2h(src, dst):
        c = d2h(src, dst)
        seen["d2h"].append(c)
        return c

    def spy_h2d(src):
        seen["alloc_streams"].append(fake.current.name)  # stream current when allocating
        out, c = h2d(src)
        seen["h2d"].append(c)
        return out, c

    backend.d2h, backend.h2d = spy_d2h, spy_h2d
    return ctx, fake, seen


def _twin_step(model, twin, ctx, fake=None, backward_stream=None):
    cfg = model.cfg
    x, y = make_batch(cfg, 2, 16)
    with ctx:
        out = model(x)
    loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
    if fake is not None and backward_stream is not None:
        fake.current = FakeStream(backward_stream, fake.log)
    loss.backward()
    ref = F.cross_entropy(twin(x).flatten(0, 1), y.flatten())
    ref.backward()
    return loss, ref


@pytest.mark.parametrize("stash", [1, 5])
def test_emulated_streams_bitwise_and_bounded_stash(stash):
    """With copies reported in flight, grads stay bitwise exact and the stash never exceeds its bound."""
    model = ToyLlama(ToyLlamaConfig())
    twin = copy.deepcopy(model)
    ctx, fake, seen = _emulated_engine(max_fwd_stash_size=stash)
    peak = 0
    push = ctx._stash_push

    def spy_push(entry):
        nonlocal peak
        push(entry)
        peak = max(peak, len(ctx._stash))

    ctx._stash_push = spy_push
    for _ in range(2):
        loss, ref = _twin_step(model, twin, ctx)
        assert torch.equal(loss, ref)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert ctx.backend == "stream"
    assert seen["d2h"], "nothing went through the stream backend"
    assert 0 < peak <= stash
    assert ctx._stash_bytes == 0 and not ctx._stash  # drained at the end of backward
    assert ctx.pool.stats()["in_use_bytes"] == 0


def test_d2h_ordered_after_producer_and_sources_released_safely():
    """Rule 2: each D2H waits on the live compute stream; a source is dropped only after its copy is done or the producer stream waits on it."""
    model = ToyLlama(ToyLlamaConfig())
    twin = copy.deepcopy(model)
    ctx, fake, seen = _emulated_engine(max_fwd_stash_size=2)
    _twin_step(model, twin, ctx)
    log = fake.log
    for c in seen["d2h"]:
        i = log.index(("record", c.done.stream.name, id(c.done)))
        before = log[:i]
        assert ("wait_stream", c.done.stream.name, "compute") in before
        waited = ("wait_event", "compute", id(c.done)) in log
        assert waited or c.done.polls > FakeEvent.lag, "source released while its copy was in flight"


def test_reload_allocated_on_consumer_stream_and_awaited_there():
    """Rules 3-4: reloads are allocated on the live backward stream (not the side stream, not a cached one) and that stream waits on each copy."""
    model = ToyLlama(ToyLlamaConfig())
    twin = copy.deepcopy(model)
    ctx, fake, seen = _emulated_engine(max_fwd_stash_size=1, prefetch_bytes=1 << 20)
    loss, ref = _twin_step(model, twin, ctx, fake, backward_stream="bwd")
    assert torch.equal(loss, ref)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert seen["h2d"], "backward reloaded nothing"
    assert set(seen["alloc_streams"]) == {"bwd"}
    for c in seen["h2d"]:
        assert ("wait_event", "bwd", id(c.done)) in fake.log, "compute read a reload without waiting"
        assert ("wait_event", "compute", id(c.done)) not in fake.log, "waited on a stale stream"
    assert fake.created == 1  # one side stream per engine, made lazily


def test_stalls_are_measured_when_copies_are_late():
    """A reload still in flight when needed is timed as stall on the consumer stream."""
    model = ToyLlama(ToyLlamaConfig())
    twin = copy.deepcopy(model)
    ctx, fake, _ = _emulated_engine(max_fwd_stash_size=1, prefetch_bytes=0)
    _twin_step(model, twin, ctx)
    s = ctx.ledger.summary(synchronize=True)
    assert s["stall_seconds"] > 0
    assert s["d2h_seconds"] > 0 and s["h2d_seconds"] > 0
    assert s["d2h_bytes"] == ctx.pool.stats()["received_bytes"]
    # Sources still alive in the stash at backward are used as is, not reloaded.
    assert 0 < s["h2d_bytes"] < s["d2h_bytes"]
