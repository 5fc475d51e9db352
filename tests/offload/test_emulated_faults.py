"""Every ordering call of the engine's stream path is needed: switched off one at a time
(offload.testing.inject_fault, NOTE [ Ordering faults ] in offload/streams.py), each makes the
emulated run fail, while the intact engine runs the same workout clean and bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from emulated_testkit import disk_workout, ordering_workout, reused_source_workout, unconsumed_prefetch_workout
from offload import streams
from offload.disk import DiskTierError
from offload.testing import FAULT_NAMES, EmulatedAccelerator, inject_fault
from offload_testkit import assert_same_grads

pytestmark = pytest.mark.emulated

# The side of each ordering call the checker reports when it is missing.
EXPECTED_KIND = {
    "d2h_waits_producer": "unordered access",  # the D2H reads a tensor its producer wrote, unordered
    "h2d_waits_compute": "unordered access",  # the H2D writes a block compute allocated, unordered
    "copy_event": "unordered access",  # compute reads a reload: the event it waited on was never recorded
    "live_current_stream": "unordered access",  # copies ordered after a stale stream, not the user's
    "compute_outside_side": "free before access",  # the "producer" is the side stream: the release is a no-op
    "h2d_alloc_on_compute": "free before access",  # a reload's block belongs to the side stream
    "h2d_waits_d2h": "unordered access",  # a shared copy's reload reads host bytes its D2H still writes
    "compute_waits_copy": "unordered access",  # compute reads a reload it never waited for
    "stall_waits_copy": "unordered access",  # the same, when the copy is still running (timed stall)
    "record_stream": "free before access",  # a prefetched reload read on another stream, freed unrecorded
    "reused_source_record_stream": "free before access",  # an in-flight source read on another stream
    "stash_release_waits_copy": "free before access",  # a source freed while its D2H is queued
    "consumed_source_record_stream": "free before access",  # a reused source freed while its D2H is queued
    "unused_prefetch_release_waits_copy": "free before access",  # a prefetch dropped at pass end, H2D queued
    "dropped_prefetch_release_waits_copy": "free before access",  # a prefetch whose handles died, H2D queued
}
# Host-side waits: the host reads bytes the checker cannot see it read (numpy, file writes), or
# only names the wrong side; late data shows them (the tests below).
CAUGHT_BY_LATE_DATA = {
    "disk_write_waits_copy": "test_disk_writer_that_does_not_wait_writes_wrong_bytes",  # (this file)
    "verify_host_after_copy": "tests/offload/test_verify.py::test_missing_wait_on_a_reload_while_its_d2h_is_queued",
}


# The workout that reaches each call site: the ordering workout reaches all but three.
WORKOUTS = {
    "ordering": ordering_workout,
    "reused_source": reused_source_workout,
    "prefetch_unconsumed": lambda acc, **kw: unconsumed_prefetch_workout(acc, drop_first=False, **kw),
    "prefetch_dropped": lambda acc, **kw: unconsumed_prefetch_workout(acc, drop_first=True, **kw),
}
WORKOUT_OF = {
    "reused_source_record_stream": "reused_source",
    "consumed_source_record_stream": "reused_source",
    "h2d_waits_d2h": "reused_source",  # a shared copy reloaded while its D2H is in flight
    "unused_prefetch_release_waits_copy": "prefetch_unconsumed",
    "dropped_prefetch_release_waits_copy": "prefetch_dropped",
}


@pytest.mark.parametrize("late,seed", [(False, None), (True, None), (True, 0), (True, 1)],
                         ids=["check", "late", "late_seed0", "late_seed1"])
@pytest.mark.parametrize("workout", list(WORKOUTS))
def test_workout_is_clean_and_bitwise(workout, late, seed):
    """The intact engine: zero hazards, the twin's gradients bit for bit, reloads on the stream path
    (late data run at the latest point, and at random points with a seed)."""
    with EmulatedAccelerator(late=late, seed=seed) as acc:
        model, twin, ctx = WORKOUTS[workout](acc)
    acc.assert_no_hazards()
    assert_same_grads(model, twin)
    s = ctx.ledger.summary()
    assert ctx.backend == "stream" and s["h2d_bytes"] > 0
    if workout == "ordering":
        assert s["steps"] == 2
    if workout == "reused_source":
        assert "reused_source" in [r.note for r in ctx.ledger.records]  # the path the workout is for


def test_every_fault_is_listed():
    assert set(EXPECTED_KIND) | set(CAUGHT_BY_LATE_DATA) == set(FAULT_NAMES)
    assert not set(EXPECTED_KIND) & set(CAUGHT_BY_LATE_DATA)
    assert set(WORKOUT_OF) <= set(FAULT_NAMES)
    assert not streams._FAULTS
    root = Path(__file__).resolve().parents[2]
    for where in CAUGHT_BY_LATE_DATA.values():  # the named tests exist
        path, _, name = where.rpartition("::")
        assert f"def {name}(" in (root / path if path else Path(__file__)).read_text(), where


@pytest.mark.parametrize("fault", list(EXPECTED_KIND))
def test_each_ordering_call_is_needed(fault):
    """Without this ordering call (this call site) the checker reports a hazard of the expected kind."""
    # Without timing every reload's wait takes the untimed branch of _wait (and an unrecorded event
    # has no elapsed time); with it, the emulator's copies are not done yet when compute needs them
    # (query() is False until something orders after them): the timed stall branch.
    kw = {"timing": False} if fault in ("copy_event", "compute_waits_copy") else {}
    with inject_fault(fault), EmulatedAccelerator() as acc:
        WORKOUTS[WORKOUT_OF.get(fault, "ordering")](acc, **kw)
    assert not streams._FAULTS
    kinds = {h.kind for h in acc.hazards}
    assert EXPECTED_KIND[fault] in kinds, f"{fault}: hazards {sorted(kinds)}"


@pytest.mark.parametrize("fault,timing", [("copy_event", False), ("compute_waits_copy", False),
                                          ("stall_waits_copy", True)])
def test_missing_reload_wait_changes_bytes_in_late_mode(fault, timing):
    """Without the checker: late data makes a missing wait on a reload read poison (a crash or wrong grads)."""
    with inject_fault(fault), EmulatedAccelerator(late=True, check=False) as acc:
        try:
            model, twin, _ = ordering_workout(acc, timing=timing)
        except (RuntimeError, IndexError):
            return  # poison reached an op that checks its input (e.g. a class index of -1)
    with pytest.raises(AssertionError):
        assert_same_grads(model, twin)


@pytest.mark.parametrize("late", [False, True], ids=["check", "late"])
def test_disk_workout_is_clean_and_bitwise(tmp_path, late):
    with EmulatedAccelerator(late=late) as acc:
        model, twin, ctx = disk_workout(acc, str(tmp_path))
    try:
        acc.assert_no_hazards()
        assert_same_grads(model, twin)
        s = ctx.ledger.summary()
        assert ctx.backend == "stream" and s["tiers"]["disk"]["count"] == s["offloaded_count"] > 0
    finally:
        ctx.close()


def test_disk_writer_that_does_not_wait_writes_wrong_bytes(tmp_path):
    """The writer thread reads the staging buffer with numpy (the checker cannot see it): without its
    wait on the D2H it writes poison, which the file check or the gradients catch. No late work runs
    before backward (lag: queries never complete), so the writer always comes first."""
    with inject_fault("disk_write_waits_copy"), EmulatedAccelerator(late=True, check=False, lag=1 << 30) as acc:
        try:
            model, twin, ctx = disk_workout(acc, str(tmp_path))
        except DiskTierError:
            return  # the bytes changed under the writer (the file's check names them)
    ctx.close()
    with pytest.raises(AssertionError):
        assert_same_grads(model, twin)


def test_inject_fault_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown fault"):
        with inject_fault("no_such_call"):
            pass


@pytest.mark.emulated
def test_reused_source_survives_a_poll_while_loading_ahead(monkeypatch):
    """An unpack that uses an in-flight source as it is returns that source even when loading ahead (which
    polls the stash) releases the stash entry meanwhile: it returned ``entry.src`` read again after the
    load-ahead, None once released, and autograd failed with "unpack_hook expected to be a Tensor" (seen
    as a flaky two-thread emulator test). Gradients stay bitwise."""
    from offload._backward import _Backward

    load_ahead = _Backward._load_ahead
    dropped = []

    def poll_then_load_ahead(self, h, p):
        if h.stash is not None and h.stash.src is not None:
            h.stash.src = None  # what the schedule's poll does once the copy is done
            dropped.append(h)
        load_ahead(self, h, p)

    monkeypatch.setattr(_Backward, "_load_ahead", poll_then_load_ahead)
    with EmulatedAccelerator(late=True) as acc:
        model, twin, ctx = reused_source_workout(acc)
    assert dropped, "no unpack used an in-flight source"
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_reload_from_the_host_pool_asks_the_driver_nothing(monkeypatch):
    """The engine knows whether each host buffer is page-locked, so a reload passes that on instead of
    asking ``src.is_pinned()`` (on CUDA a ``cudaPointerGetAttributes`` per reload, on the host's
    critical path in backward)."""
    asked: list[int] = []
    real = torch.Tensor.is_pinned

    def is_pinned(self, *args, **kwargs):
        asked.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    with EmulatedAccelerator() as acc:
        model, twin, ctx = WORKOUTS["ordering"](acc)
    assert_same_grads(model, twin)
    assert ctx.ledger.summary()["h2d_bytes"] > 0 and not asked, f"{len(asked)} is_pinned calls"
