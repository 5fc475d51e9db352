"""The copy schedule's forward bounds (NOTE [ Copy schedule ] item 2), on the emulated accelerator with copies that
never report done (a device far behind the host): what stays in flight at the forward's end, step by step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload import OffloadActivations
from offload.testing import EmulatedAccelerator
from offload_testkit import assert_same_grads, twin_of

pytestmark = pytest.mark.emulated

WIDTH, ROWS = 64, 32
ACT = WIDTH * ROWS * 4


def _model(layers: int, narrow_tail: int = 0) -> nn.Module:
    """``layers`` Linear+Tanh blocks; the last ``narrow_tail`` of them half as wide (saves of ``ACT // 2``)."""
    torch.manual_seed(0)
    widths = [WIDTH] * (layers - narrow_tail) + [WIDTH // 2] * narrow_tail
    return nn.Sequential(*[m for i, w in enumerate(widths)
                           for m in (nn.Linear(widths[i - 1] if i else WIDTH, w), nn.Tanh())])


def _steps(model: nn.Module, twin: nn.Module, ctx: OffloadActivations, n: int) -> list[tuple[int, int]]:
    """``n`` training steps; per step (bytes in flight when the model's last module had run, inside the engine,
    its saves kept or offloaded; waits counted)."""
    out, seen = [], []
    hook = model[-1].register_forward_hook(lambda *a: seen.append(ctx._sched.inflight_bytes))
    for i in range(n):
        x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(i))
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
        twin(x).square().mean().backward()
        out.append((seen[-1], ctx.ledger.step_totals[-1].d2h_waits))
    hook.remove()
    return out


@pytest.mark.parametrize("native", [False, True], ids=["python_hook", "cpp_hook"])
@pytest.mark.parametrize("kept_tail, tail", [(0, None), (6, "excluded"), (12, "below_min_size")],
                         ids=["all_offloaded", "first_blocks_offloaded", "tail_kept_by_size"])
def test_the_forward_ends_with_its_offloaded_bytes_off_the_device(kept_tail, tail, native):
    """From the second step on, the forward's last module finishes with at most the window in flight (a few
    copies): every other source was released before the forward's last allocations, at the packs (kept ones
    too, by the Python hook and the C++ one alike), whether everything is offloaded or only the first blocks
    (the rest excluded, or kept because they are small: no module hook then, only the packs see them); the
    first step keeps the old caps (5 copies). Gradients stay bitwise."""
    # (first blocks: six offloaded, more copies than the window; the small tail saves more than the window
    # after the last copy was issued, so only its kept packs can release the sources)
    layers = 6 + kept_tail if tail == "below_min_size" else 12
    with EmulatedAccelerator(lag=10**9, check=True) as acc:  # copies never report done: only waits free
        model = _model(layers, kept_tail if tail == "below_min_size" else 0)
        twin = twin_of(model)
        min_size = ACT * 3 // 4 if tail == "below_min_size" else 0
        ctx = OffloadActivations(device="cpu", min_offload_size=min_size, native_hooks=native)
        if tail == "excluded":
            for m in list(model)[2 * (layers - kept_tail):]:
                ctx.exclude(m)
        got = _steps(model, twin, ctx, 3)
    acc.assert_no_hazards()
    assert_same_grads(model, twin)
    window = 4 * ctx._sched.max_copy
    (first, first_waits), *later = got
    assert first <= 5 * ctx._sched.max_copy  # the old caps on the first step
    assert first_waits > 0 or not kept_tail == 0  # (all offloaded: more than 5 copies, so it waited)
    for at_exit, waits in later:
        assert at_exit <= window, (at_exit, window)
        assert waits > 0  # (the device never reports a copy done: only waits release sources)


def test_a_budget_the_step_never_reaches_never_waits():
    """``device_budget_bytes`` above anything the step holds: no wait on a copy at all, every source held
    until its copy is known done (here: the end of the step), gradients bitwise."""

    class Stats(EmulatedAccelerator):
        def memory_allocated(self, device=None) -> int:
            return 1 << 20

        def max_memory_allocated(self, device=None) -> int:
            return 1 << 20

    with Stats(lag=10**9) as acc:
        model = _model(4)
        twin = twin_of(model)
        ctx = OffloadActivations(device="cpu", min_offload_size=0, device_budget_bytes=1 << 40)
        got = _steps(model, twin, ctx, 3)
    acc.assert_no_hazards()
    assert_same_grads(model, twin)
    assert all(waits == 0 for _, waits in got[1:])
    assert all(at_exit >= 4 * ACT for at_exit, _ in got[1:])  # nothing released: all still in flight


def test_a_budget_is_kept_by_waiting_on_the_oldest_copies():
    """With ``device_budget_bytes`` below what the forward would hold, compute waits on the oldest copies when
    the allocator's count (as the device reports it) would pass the budget, and only then."""

    class Stats(EmulatedAccelerator):
        allocated = 0

        def memory_allocated(self, device=None) -> int:
            return self.allocated

        def max_memory_allocated(self, device=None) -> int:
            return self.allocated

    with Stats(lag=10**9) as acc:
        model = _model(4)
        twin = twin_of(model)
        ctx = OffloadActivations(device="cpu", min_offload_size=0, device_budget_bytes=10 * ACT)
        acc.allocated = 0  # far below the budget: no wait
        quiet = _steps(model, twin, ctx, 2)
        acc.allocated = 20 * ACT  # above it: every copy is waited on at once
        tight = _steps(model, twin, ctx, 1)
    assert_same_grads(model, twin)
    assert quiet[-1][1] == 0 and quiet[-1][0] >= 4 * ACT
    assert tight[0][1] > 0 and tight[0][0] == 0
