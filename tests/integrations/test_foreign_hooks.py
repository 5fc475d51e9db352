"""Another offloader's saved-tensor hooks around ours are reported once, with the fix, at the user's line;
TRL's flag works with this engine behind it (offload.compat.trl.patch_sft_trainer)."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
import torch.utils.checkpoint as checkpoint

from offload import NoOpManager, OffloadActivations
from offload_testkit import require_native


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def _two_steps(outer, engine: OffloadActivations, model: torch.nn.Module,
               about: str = "another saved-tensor hooks") -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with outer:
                with engine:
                    loss = model(torch.randn(4, 16)).sum()
            loss.backward()
    return [w for w in caught if about in str(w.message)]


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


@pytest.mark.parametrize("outer", ["noop_manager", "tracker", "none"])
def test_outer_contexts_that_lose_nothing_do_not_warn(outer):
    """Contexts around an engine that lose nothing to it are no reason to warn (NOTE [ Nested hooks ]
    rule 2): NoOpManager (invisible by design), a PackedBytesTracker (it observes the engine's packs,
    and does record them)."""
    from offload.profiling import PackedBytesTracker

    ctx = {"noop_manager": NoOpManager, "tracker": PackedBytesTracker, "none": torch.enable_grad}[outer]()
    engine = OffloadActivations(device="cpu", min_offload_size=0)
    assert _two_steps(ctx, engine, _model(), about="OffloadActivations") == []
    if outer == "tracker":
        assert ctx.summary()["packed_bytes"] == engine.ledger.summary()["packed_bytes"] > 0


def test_inside_another_engine_warns_once():
    """An engine entered inside another engine: the outer ledger records nothing of it, so one warning
    (it was silent); the inner engine records everything."""
    outer, inner = OffloadActivations(device="cpu"), OffloadActivations(device="cpu", min_offload_size=0)
    msgs = [str(w.message) for w in _two_steps(outer, inner, _model(), about="inside another engine")]
    assert len(msgs) == 1 and "outer engine's ledger records nothing" in msgs[0], msgs
    assert outer.ledger.summary()["packed_count"] == 0 and inner.ledger.summary()["offloaded_bytes"] > 0


def test_tracker_with_user_functions_around_an_engine_warns():
    """A tracker whose user pack/unpack functions would run is shadowed by an engine inside it: warned."""
    from offload.profiling import PackedBytesTracker

    tracker = PackedBytesTracker(pack_hook=lambda t: t, unpack_hook=lambda t: t)
    (w,) = _two_steps(tracker, OffloadActivations(device="cpu"), _model())
    assert "profiling.packed.PackedBytesTracker" in str(w.message)


def _inside_engine(inner_factory, engine, model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with engine:
                with inner_factory():
                    loss = model(torch.randn(4, 16)).sum()
            loss.backward()
    return [str(w.message) for w in caught if "inside this engine" in str(w.message)]


@pytest.fixture(params=["c_read", "python_read"])
def innermost_read(request, monkeypatch):
    """How module calls read the innermost hooks (NOTE [ Nested hooks ] rule 3): the C++ extension's read
    where it is loaded, torch's call where it is not (``native_hooks=False`` in a process that never loaded
    it)."""
    from offload import _native

    if request.param == "c_read":
        require_native()
        return {}
    monkeypatch.setattr(_native, "_module", None)
    return {"native_hooks": False}


def _check_read(engine: OffloadActivations, kw: dict) -> None:
    from offload.modules import _tls

    with engine:
        assert (_tls.watch[2] is None) == ("native_hooks" in kw), _tls.watch


def test_save_on_cpu_inside_the_engine_warns_once(innermost_read):
    """save_on_cpu entered inside the engine takes what is saved inside it away from the engine (not
    offloaded by it, not in its ledger): one warning, at the first module call under it (it was silent),
    with either read of the innermost hooks."""
    engine, model = OffloadActivations(device="cpu", min_offload_size=0, **innermost_read), _model()
    _check_read(engine, innermost_read)
    msgs = _inside_engine(torch.autograd.graph.save_on_cpu, engine, model)
    assert len(msgs) == 1 and "save_on_cpu" in msgs[0] and "Sequential" in msgs[0], msgs
    assert engine.ledger.summary()["packed_count"] == 0


@pytest.mark.parametrize("inner", ["checkpoint", "noop_manager", "tracker", "same_engine"])
def test_contexts_inside_the_engine_that_lose_nothing_do_not_warn(inner, innermost_read):
    """Checkpointing, NoOpManager, a tracker (observes, installs no hooks) and the same engine again,
    inside the engine: no warning, with either read of the innermost hooks."""
    from offload.profiling import PackedBytesTracker

    engine, model = OffloadActivations(device="cpu", min_offload_size=0, **innermost_read), _model()
    _check_read(engine, innermost_read)
    if inner == "checkpoint":
        def run(x):
            return checkpoint.checkpoint(model, x, use_reentrant=False)
        factory, m = torch.enable_grad, run
    else:
        factory = {"noop_manager": NoOpManager, "tracker": PackedBytesTracker, "same_engine": lambda: engine}[inner]
        m = model
    assert _inside_engine(factory, engine, m) == []


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
