"""OffloadConfig(verify=True): offloaded bytes checksummed at pack, checked when backward reads them;
a named error (module, shape, step, side) on a mismatch (NOTE [ Verified offload ])."""

from __future__ import annotations

import pytest
import torch

from offload import OffloadActivations, OffloadConfig, OffloadError, OffloadVerifyError
from offload.testing import EmulatedAccelerator, inject_fault
from offload_testkit import assert_same_grads, cpu_ctx, loss_of, make_inputs, make_model, run_step, twin_of

pytestmark = pytest.mark.emulated


def test_verify_is_off_by_default_and_validated():
    assert OffloadConfig().verify is False
    with pytest.raises(TypeError, match="verify"):
        OffloadConfig(verify="yes")
    assert OffloadActivations(device="cpu", verify=True).config.verify is True


@pytest.mark.parametrize("use_streams", [False, True], ids=["sync", "emulated_streams"])
def test_verify_passes_on_a_correct_engine_and_changes_nothing(use_streams):
    """A correct run with verify=True: no error, gradients bitwise equal to the twin, reloads checked."""
    model = make_model("toy")
    twin = twin_of(model)
    with EmulatedAccelerator(late=True) as acc:
        ctx = cpu_ctx(verify=True, use_streams=use_streams, max_fwd_stash_size=1, max_inflight_bytes=1)
        for i in range(2):
            inputs = make_inputs("toy", seed=i)
            assert torch.equal(run_step(model, inputs, ctx), run_step(twin, inputs))
    acc.assert_no_hazards()
    assert_same_grads(model, twin)
    s = ctx.ledger.summary()
    assert s["h2d_bytes"] > 0 and s["offloaded_count"] > 0


def test_missing_wait_on_a_reload_raises_naming_the_h2d_side():
    """Late data + compute never waiting for its reload: verify=True raises OffloadVerifyError (side h2d)
    naming the module, shape and step, before a wrong gradient is computed."""
    model = make_model("toy")
    with inject_fault("compute_waits_copy"), EmulatedAccelerator(late=True, check=False):
        ctx = cpu_ctx(verify=True, max_fwd_stash_size=1, max_inflight_bytes=1, prefetch_bytes=0, timing=False)
        with ctx:
            loss = loss_of(model, make_inputs("toy"))
        with pytest.raises(OffloadVerifyError) as ei:
            loss.backward()
    e = ei.value
    assert isinstance(e, OffloadError) and e.side == "h2d" and e.step == 0 and e.shape
    assert "side: h2d" in str(e) and e.module in str(e) and str(list(e.shape)) in str(e)


@pytest.mark.parametrize("host_waits", [True, False], ids=["intact", "fault_verify_host_after_copy"])
def test_missing_wait_on_a_reload_while_its_d2h_is_queued(host_waits):
    """Two views of one storage (one host copy, two users: reloaded, not reused) and nothing run late
    before backward: the reload's D2H is still queued when compute reads the reload without waiting.
    verify=True names h2d, because it synchronizes on the reload's copy before it sums the host copy;
    without that wait (the fault) it would sum the unwritten host copy and name d2h."""
    x = torch.randn(4096, requires_grad=True)
    faults = ("compute_waits_copy",) + (() if host_waits else ("verify_host_after_copy",))
    with inject_fault(*faults), EmulatedAccelerator(late=True, check=False, lag=1 << 30):
        ctx = cpu_ctx(verify=True, prefetch_bytes=0, timing=False)
        with ctx:
            t = x * 2.0
            loss = (t[:2048].sin() + t[2048:].cos()).sum()
            del t  # (a live original is not reloaded: NOTE [ Copy schedule ] item 6)
        with pytest.raises(OffloadVerifyError) as ei:
            loss.backward()
    assert ei.value.side == ("h2d" if host_waits else "d2h")
    assert all(r.note != "reused_source" for r in ctx.ledger.records)


def test_d2h_that_does_not_wait_for_its_producer_raises_naming_the_d2h_side():
    """The producer's kernel queued late (a parked stream) and the D2H not waiting for it: the host copy
    holds the wrong bytes, and verify=True says the d2h side differed."""
    a = torch.randn(4096, requires_grad=True)
    with inject_fault("d2h_waits_producer"), EmulatedAccelerator(late=True, check=False) as acc:
        ctx = cpu_ctx(verify=True, max_fwd_stash_size=1, max_inflight_bytes=1, timing=False)
        with ctx:
            acc._sleep()  # the compute stream is parked: its next kernels run late
            h = a * 2.0
            loss = h.sin().sum()  # pack(h): the D2H is issued before h is written
        # A live original is not reloaded (NOTE [ Copy schedule ] item 6): drop h, and the late kernels
        # that hold it too, so backward reloads the wrong bytes the D2H copied.
        del h
        acc.synchronize()
        with pytest.raises(OffloadVerifyError) as ei:
            loss.backward()
    assert ei.value.side == "d2h"
