"""Another offloader's saved-tensor hooks around ours are reported once, with the fix, at the user's line;
TRL's flag works with this engine behind it (offload.compat.trl.patch_sft_trainer)."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
import torch.utils.checkpoint as checkpoint

from offload import NoOpManager, OffloadActivations


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def _two_steps(outer, engine: OffloadActivations, model: torch.nn.Module) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with outer:
                with engine:
                    loss = model(torch.randn(4, 16)).sum()
            loss.backward()
    return [w for w in caught if "another saved-tensor hooks" in str(w.message)]


def _trl_engine():
    trl_offloading = pytest.importorskip("trl.models.activation_offloading")
    # TRL's engine asks for the current accelerator when built; on CPU there is none.
    with mock.patch.object(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu")):
        return trl_offloading.OffloadActivations(use_streams=False)


def test_inside_trls_engine_warns_once_with_the_fix():
    """Ours entered inside TRL's engine: one warning over two steps, naming TRL's class, both fixes, and
    pointing at this file (the user's line); ours still offloads (it is the innermost)."""
    engine, model = OffloadActivations(device="cpu", min_offload_size=0), _model()
    (w,) = _two_steps(_trl_engine(), engine, model)
    msg = str(w.message)
    assert "trl.models.activation_offloading.OffloadActivations" in msg
    assert "activation_offloading=False" in msg and "patch_sft_trainer()" in msg
    assert w.filename == __file__
    assert engine.ledger.summary()["offloaded_bytes"] > 0


def test_inside_save_on_cpu_warns():
    """save_on_cpu around the engine is reported too (any other offloader, not only TRL's)."""
    (w,) = _two_steps(torch.autograd.graph.save_on_cpu(), OffloadActivations(device="cpu"), _model())
    assert "save_on_cpu" in str(w.message)


@pytest.mark.parametrize("outer", ["nested_engine", "noop_manager", "none"])
def test_expected_outer_contexts_do_not_warn(outer):
    """Our own contexts around an engine are no reason to warn."""
    ctx = {"nested_engine": lambda: OffloadActivations(device="cpu"), "noop_manager": NoOpManager,
           "none": torch.enable_grad}[outer]()
    assert _two_steps(ctx, OffloadActivations(device="cpu"), _model()) == []


def test_engine_inside_checkpoint_does_not_warn():
    """torch.utils.checkpoint's own hooks around an engine entered in the checkpointed function: no warning."""
    engine, model = OffloadActivations(device="cpu"), _model()

    def block(x):
        with engine:
            return model(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.checkpoint(block, torch.randn(4, 16, requires_grad=True), use_reentrant=False).sum().backward()
    assert not [w for w in caught if "another saved-tensor hooks" in str(w.message)]
