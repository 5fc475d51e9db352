"""Offloading changes no bit: loss and every grad equal a no-offload twin (CPU, device="cpu")."""

from __future__ import annotations

import pytest
import torch

from offload_testkit import (
    assert_reconciles,
    assert_really_offloaded,
    assert_same_grads,
    cpu_ctx,
    loss_of,
    make_inputs,
    make_model,
    run_step,
    twin_of,
)

MODELS = ["mlp", "conv", "toy", "toy_tied"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", MODELS)
def test_one_step_bitwise(kind, dtype):
    """One offloaded step gives the twin's loss and grads bit for bit, with bytes really moved."""
    model = make_model(kind, dtype)
    twin = twin_of(model)
    inputs = make_inputs(kind, dtype)
    ctx = cpu_ctx()
    want = run_step(twin, inputs)
    got = run_step(model, inputs, ctx)
    assert torch.equal(got, want), (got.item(), want.item())
    assert_same_grads(model, twin)
    s = assert_really_offloaded(ctx)
    assert_reconciles(s)
    assert s["steps"] == 1


@pytest.mark.parametrize("use_pin_memory", [True, False], ids=["pin", "nopin"])
@pytest.mark.parametrize("use_streams", [True, False], ids=["streams", "sync"])
def test_backend_flags_bitwise(use_streams, use_pin_memory):
    """Every use_streams x use_pin_memory combination on device="cpu" runs and is bitwise exact."""
    model = make_model("toy", torch.bfloat16)
    twin = twin_of(model)
    inputs = make_inputs("toy")
    ctx = cpu_ctx(use_streams=use_streams, use_pin_memory=use_pin_memory)
    for _ in range(2):
        want = run_step(twin, inputs)
        got = run_step(model, inputs, ctx)
        assert torch.equal(got, want)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)


def test_several_steps_with_optimizer_bitwise():
    """Three optimizer steps with one reused engine stay bitwise identical to the twin."""
    model = make_model("toy")
    twin = twin_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_t = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    ctx = cpu_ctx()
    for i in range(3):
        inputs = make_inputs("toy", seed=10 + i)
        want = run_step(twin, inputs)
        got = run_step(model, inputs, ctx)
        assert torch.equal(got, want), f"step {i}"
        assert_same_grads(model, twin)
        opt.step()
        opt_t.step()
        opt.zero_grad(set_to_none=True)
        opt_t.zero_grad(set_to_none=True)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n
    assert ctx.ledger.summary()["steps"] == 3


def test_default_min_offload_size_still_offloads_toy_activations():
    """With the torchtune default min_offload_size=1024 the toy model still offloads its big activations."""
    model = make_model("toy")
    twin = twin_of(model)
    inputs = make_inputs("toy")
    ctx = cpu_ctx(min_offload_size=1024)
    run_step(twin, inputs)
    run_step(model, inputs, ctx)
    assert_same_grads(model, twin)
    s = assert_really_offloaded(ctx)
    assert s["kept_by_reason"].get("too_small", 0) > 0, "the tiny config saves some sub-1KiB tensors"
    assert_reconciles(s)


def test_autocast_bf16_bitwise():
    """Under CPU autocast(bf16) (cast weight copies are saved, some twice) offloading stays bitwise."""
    model = make_model("toy")
    twin = twin_of(model)
    inputs = make_inputs("toy")
    ctx = cpu_ctx()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with ctx:
            got = loss_of(model, inputs)
        want = loss_of(twin, inputs)
    got.backward()
    want.backward()
    assert torch.equal(got, want)
    assert_same_grads(model, twin)
    assert_reconciles(assert_really_offloaded(ctx))


def test_lstm_bitwise():
    """A 2-layer LSTM (many saved gate views) is bitwise under offloading."""
    torch.manual_seed(0)
    model = torch.nn.LSTM(16, 32, num_layers=2, batch_first=True)
    twin = twin_of(model)
    x = torch.randn(4, 10, 16)
    ctx = cpu_ctx()
    with ctx:
        got = model(x)[0].square().sum()
    got.backward()
    want = twin(x)[0].square().sum()
    want.backward()
    assert torch.equal(got, want)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
