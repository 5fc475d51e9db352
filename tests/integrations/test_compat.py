"""The peers' documented call forms (torchtune, TRL) work unchanged; ambiguous positional calls fail loudly."""

from __future__ import annotations

import contextlib

import pytest
import torch

import offload
from offload import OffloadActivations, get_act_offloading_ctx_manager
from offload.compat import torchtune as tt
from offload.compat import trl
from offload_testkit import (
    TINY,
    ToyLlama,
    assert_really_offloaded,
    assert_same_grads,
    make_batch,
    run_step,
    twin_of,
)


def _settings(ctx):
    return ctx.use_pin_memory, ctx.use_streams, ctx.max_fwd_stash_size, ctx.min_offload_size


def test_positional_stash_and_min_size_are_refused_with_the_fix():
    """OffloadActivations(True, True, 1024, 5) could mean either peer's order: TypeError naming both fixes."""
    with pytest.raises(TypeError) as ei:
        OffloadActivations(False, False, 2, 4096, device="cpu")
    msg = str(ei.value)
    for needle in ("max_fwd_stash_size", "min_offload_size", "offload.compat.torchtune", "offload.compat.trl"):
        assert needle in msg, msg


def test_shared_positional_head_and_keywords_of_both_peers():
    """(use_pin_memory, use_streams) stay positional; both peers' keyword forms set the same fields."""
    a = OffloadActivations(False, False, max_fwd_stash_size=2, min_offload_size=4096, device="cpu")
    b = OffloadActivations(use_pin_memory=False, use_streams=False, min_offload_size=4096,
                           max_fwd_stash_size=2, device="cpu")
    assert _settings(a) == _settings(b) == (False, False, 2, 4096)


def test_torchtune_positional_order():
    """offload.compat.torchtune.OffloadActivations reads (pin, streams, max_fwd_stash_size, min_offload_size)."""
    ctx = tt.OffloadActivations(False, False, 2, 4096, device="cpu")
    assert _settings(ctx) == (False, False, 2, 4096)
    assert isinstance(ctx, OffloadActivations)
    assert tt.NoOpManager is offload.NoOpManager


def test_trl_positional_order():
    """offload.compat.trl.OffloadActivations reads (pin, streams, min_offload_size, max_fwd_stash_size)."""
    ctx = trl.OffloadActivations(False, False, 4096, 2, device="cpu")
    assert _settings(ctx) == (False, False, 2, 4096)
    assert trl.NoOpManager is offload.NoOpManager


def _toy():
    torch.manual_seed(0)
    return ToyLlama(TINY), make_batch(TINY, 2, 16)


def _check_bitwise_with_head_excluded(model, inputs, ctx):
    twin = twin_of(model)
    run_step(model, inputs, ctx)
    run_step(twin, inputs)
    assert_same_grads(model, twin)
    s = assert_really_offloaded(ctx)
    assert s["kept_by_reason"].get("excluded_region", 0) > 0, s["kept_by_reason"]


def test_trl_ctx_manager_keyword_call_unchanged():
    """TRL's call (no enable flag, min/max by name, warn_if_no_head) returns an engine with the head excluded."""
    model, inputs = _toy()
    ctx = get_act_offloading_ctx_manager(model=model, use_pin_memory=False, use_streams=False,
                                         min_offload_size=0, max_fwd_stash_size=3, warn_if_no_head=True,
                                         device="cpu")
    assert isinstance(ctx, OffloadActivations)
    assert _settings(ctx) == (False, False, 3, 0)
    _check_bitwise_with_head_excluded(model, inputs, ctx)


def test_trl_ctx_manager_positional_in_compat():
    """offload.compat.trl.get_act_offloading_ctx_manager takes TRL's full positional order."""
    model, inputs = _toy()
    ctx = trl.get_act_offloading_ctx_manager(model, False, False, 0, 3, False, device="cpu")
    assert _settings(ctx) == (False, False, 3, 0)
    _check_bitwise_with_head_excluded(model, inputs, ctx)


def test_torchtune_ctx_manager_positional_unchanged():
    """torchtune's (model, enable_activation_offloading) call: True gives an engine, False a null context."""
    model, inputs = _toy()
    ctx = tt.get_act_offloading_ctx_manager(model, True, device="cpu", min_offload_size=0)
    _check_bitwise_with_head_excluded(model, inputs, ctx)
    assert isinstance(get_act_offloading_ctx_manager(model, False), contextlib.nullcontext)


def test_ctx_manager_second_positional_must_be_the_enable_flag():
    """A non-bool second positional (e.g. TRL-style settings passed by position) is refused with the fix."""
    model, _ = _toy()
    with pytest.raises(TypeError, match="enable_activation_offloading.*offload.compat.trl"):
        get_act_offloading_ctx_manager(model, 1)
    with pytest.raises(TypeError):
        get_act_offloading_ctx_manager(model, True, True, 1024, 5)  # too many positionals: not silent


def test_trl_update_model_params():
    """TRL's ctx.update_model_params(model) is accepted (the model's parameters are then never offloaded)."""
    model, inputs = _toy()
    ctx = trl.OffloadActivations(device="cpu", min_offload_size=0)
    ctx.update_model_params(model)
    twin = twin_of(model)
    run_step(model, inputs, ctx)
    run_step(twin, inputs)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
