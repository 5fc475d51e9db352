"""The peers' stream races, planted in a small engine of this file's own, each reported by the emulator
with both stacks; the same scenario on our engine reports nothing and gives the twin's gradients.

| planted bug                | peer                  | what the checker sees                               |
|----------------------------|-----------------------|-----------------------------------------------------|
| stale_stream               | TRL #7195 (axolotl)   | D2H on the side stream ordered after a cached, idle  |
|                            |                       | stream, not the user's stream that wrote the tensor  |
| current_stream_in_side     | torchtitan #2581      | "compute waits for the reload" asked inside the side |
|                            |                       | stream's context: the side stream waits on itself    |
| reload_before_d2h          | Megatron-LM #7398     | inline reload reads the host copy before its D2H     |
| free_source                | torchtune #1867       | source freed while its D2H is queued, no wait, no    |
|                            |                       | record_stream                                        |
| clone_after_wait           | TRL #7195             | clone of a non-contiguous reload enqueued on the     |
|                            |                       | side stream after the event compute waits on         |
| alloc_on_side              | Rule 4                | reload destination allocated on the side stream,     |
|                            |                       | freed after compute read it                          |
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from offload import OffloadActivations
from offload.testing import EmulatedAccelerator

pytestmark = pytest.mark.emulated

BUGS = ("stale_stream", "current_stream_in_side", "reload_before_d2h", "free_source", "clone_after_wait",
        "alloc_on_side")


class MiniOffloader(saved_tensors_hooks):
    """A hand-written stream offloader (the peers' shape), correct with bug=None."""

    def __init__(self, acc: EmulatedAccelerator, bug: str | None = None) -> None:
        self.acc, self.bug = acc, bug
        self.side = acc.Stream()
        self.s0 = acc.current_stream()  # what TRL cached at construction
        super().__init__(self.pack, self.unpack)

    def compute_stream(self):
        return self.s0 if self.bug == "stale_stream" else self.acc.current_stream()

    def pack(self, t):
        acc, side = self.acc, self.side
        compute = self.compute_stream()
        host = torch.empty(t.shape, dtype=t.dtype)  # host memory: allocated on no side stream
        side.wait_stream(compute)
        with acc.stream(side):
            host.copy_(t, non_blocking=True)
            done = acc.Event()
            done.record(side)
        if self.bug == "reload_before_d2h":
            return host, done, t.is_contiguous(), t  # keeps the source instead (Megatron's way)
        if self.bug != "free_source":
            compute.wait_event(done)  # Rule 2: the source's block is reusable only after the copy
        return host, done, t.is_contiguous(), None

    def unpack(self, packed):
        host, done, contiguous, _source = packed
        acc, side = self.acc, self.side
        compute = acc.current_stream()
        if self.bug == "reload_before_d2h":
            return host.clone()  # inline reload on compute: no wait on the offload event
        if self.bug == "alloc_on_side":
            with acc.stream(side):
                dev = torch.empty(host.shape, dtype=host.dtype)
        else:
            dev = torch.empty(host.shape, dtype=host.dtype)  # on compute: Rule 4
        side.wait_stream(compute)
        with acc.stream(side):
            dev.copy_(host, non_blocking=True)
            ev = acc.Event()
            ev.record(side)
            if self.bug == "clone_after_wait" and not contiguous:
                dev = dev.clone()  # enqueued after the event compute will wait on
            if self.bug == "current_stream_in_side":
                acc.current_stream().wait_event(ev)  # this is the side stream
        if self.bug != "current_stream_in_side":
            compute.wait_event(ev)
        return dev


def scenario(acc, make_engine):
    """Forward on a user stream created after the engine, with a non-contiguous saved tensor and
    intermediates that die once saved; backward on the same stream. Returns the grads."""
    torch.manual_seed(0)
    x = torch.randn(48, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    eng = make_engine()
    user = acc.Stream(late=False, name="user")  # after the engine (TRL cached its stream at construction)
    user.wait_stream(acc.default_stream())  # x and w were made on the default stream
    with acc.stream(user):
        with eng:
            h = x @ w
            a = h.t().sin()  # saves h.t(): a non-contiguous view
            b = (a * 1.5).exp()  # saves its output
            loss = b.sum()
        del h, a, b
        loss.backward()
    acc.synchronize()
    return x.grad, w.grad


def reference():
    torch.manual_seed(0)
    x = torch.randn(48, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    ((x @ w).t().sin() * 1.5).exp().sum().backward()
    return x.grad, w.grad


def test_mini_engine_without_bugs_is_clean():
    """The checker is not noisy: the correct hand-written engine reports nothing, grads bitwise, late or not."""
    want = reference()
    for late in (False, True):
        with EmulatedAccelerator(late=late) as acc:
            got = scenario(acc, lambda: MiniOffloader(acc))
        acc.assert_no_hazards()
        assert all(torch.equal(g, r) for g, r in zip(got, want))


EXPECT = {
    # bug: (kind, (stream of the later event, stream of the earlier access), (ops))
    "stale_stream": ("unordered access", ("stream1", "user"), ("aten::copy_", "aten::mm")),
    "current_stream_in_side": ("unordered access", ("user", "stream1"), None),
    "reload_before_d2h": ("unordered access", ("user", "stream1"), ("aten::clone", "aten::copy_")),
    "free_source": ("free before access", ("user", "stream1"), ("free", "aten::copy_")),
    "clone_after_wait": ("unordered access", ("user", "stream1"), (None, "aten::clone")),
    "alloc_on_side": ("free before access", ("stream1", "user"), ("free", None)),
}


@pytest.mark.parametrize("bug", BUGS)
def test_planted_peer_race_is_reported_with_both_stacks(bug):
    """Each planted bug gives a hazard of its kind, naming both streams and ops, with both Python stacks."""
    with EmulatedAccelerator() as acc:
        scenario(acc, lambda: MiniOffloader(acc, bug))
    assert acc.hazards, f"{bug}: the checker saw nothing"
    kind, streams, ops = EXPECT[bug]
    match = [h for h in acc.hazards if h.kind == kind and h.streams == streams
             and all(o is None or o == got for o, got in zip(ops or (None, None), h.ops))]
    assert match, f"{bug}: no {kind} hazard on {streams}: {[(h.kind, h.streams, h.ops) for h in acc.hazards]}"
    text = str(match[0])
    # Both stacks are there and reach into the code that issued each side.
    assert text.count("-- stack of") == 2
    assert "pack" in text or "unpack" in text, text
    assert "scenario" in text


@pytest.mark.parametrize("bug", ["current_stream_in_side", "reload_before_d2h", "clone_after_wait"])
def test_planted_read_races_change_bytes_in_late_mode(bug):
    """late=True: a missing wait on the reload reads poison, so the gradients differ (no checker needed)."""
    with EmulatedAccelerator(late=True, check=False) as acc:
        got = scenario(acc, lambda: MiniOffloader(acc, bug))
    want = reference()
    assert not all(torch.equal(g, r) for g, r in zip(got, want)), f"{bug}: late data changed nothing"


@pytest.mark.parametrize("late", [False, True], ids=["check", "late"])
@pytest.mark.parametrize("stash", [1, 5])
def test_our_engine_passes_the_same_scenario(late, stash):
    """The scenario every planted bug fails, on OffloadActivations: no hazard, the twin's grads bit for bit."""
    want = reference()
    with EmulatedAccelerator(late=late) as acc:
        def make():
            return OffloadActivations(device="cpu", min_offload_size=0, max_fwd_stash_size=stash,
                                      max_inflight_bytes=1 if stash == 1 else 1 << 30)
        got = scenario(acc, make)
    acc.assert_no_hazards()
    assert all(torch.equal(g, r) for g, r in zip(got, want))
