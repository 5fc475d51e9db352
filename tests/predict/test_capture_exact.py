"""The fake run is the real run, shapes only: the engine's decisions, record for record, and the device
peak equal a real CPU run's; for strategies that keep everything on the device the peak equals what
torch's MemTracker measures (issue 33, "Exact where it can be exact")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload import OffloadActivations
from offload.modules import register_model
from offload.regions import exclude_output_head
from offload.predict import PredictError, predict_step
from offload.predict._capture import NEVER, capture
from offload.predict._memory import DeviceMemory, replay
from offload.testing import EmulatedAccelerator

from predict_testkit import CASES, adamw, toy

DECISION_KEYS = ("packed_count", "packed_bytes", "offloaded_count", "offloaded_bytes", "kept_count", "kept_bytes",
                 "kept_by_reason", "kept_count_by_reason", "unique_bytes", "d2h_bytes", "h2d_bytes",
                 "peak_inflight_bytes")
FAST = ("toy_llama", "batchnorm", "frozen_embedding")
SLOW = tuple(n for n in CASES if n not in FAST)


def _decisions(summary: dict) -> dict:
    out = {k: summary[k] for k in DECISION_KEYS}
    out["tiers"] = {t: (row["bytes"], row["count"]) for t, row in summary["tiers"].items()}
    return out


def _check_fake_equals_real(name: str, strategy: str) -> None:
    model_fn, step_fn = CASES[name]()
    real = capture(model_fn, step_fn, strategy=strategy, optimizer=adamw, fake=False)
    fake = capture(model_fn, step_fn, strategy=strategy, optimizer=adamw, fake=True)
    assert fake.records == real.records
    if strategy.startswith("offload"):
        assert fake.records, "the engine recorded nothing: the test would prove nothing"
        assert _decisions(fake.ledger_summary) == _decisions(real.ledger_summary)
        assert fake.host_bytes == real.host_bytes
    assert replay(fake.trace).peak_bytes == replay(real.trace).peak_bytes
    assert replay(fake.trace).breakdown_at_peak() == replay(real.trace).breakdown_at_peak()


@pytest.mark.parametrize("strategy", ["offload", "offload_ac", "ac"])
@pytest.mark.parametrize("name", FAST)
def test_fake_run_decides_and_allocates_as_the_real_run(name, strategy):
    """Fake and real runs of one step: the same ledger records, totals by reason and tier, and device peak."""
    _check_fake_equals_real(name, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["offload", "offload_ac"])
@pytest.mark.parametrize("name", SLOW)
def test_fake_run_decides_as_the_real_run_on_hf_and_torch_models(name, strategy):
    """The same equality on a tiny HF Llama, GPT-2, Qwen2 and torch's TransformerEncoder."""
    _check_fake_equals_real(name, strategy)


def test_capture_harness_changes_no_decision():
    """A plain real run (no recorder, no capture) makes the records the capture's real run makes."""
    model_fn, step_fn = toy()
    with EmulatedAccelerator(check=False, late=False, dispatch=False, lag=NEVER):
        model = model_fn()
        register_model(model)  # module names from the model's root, as the capture names them
        engine = OffloadActivations(device="cpu", virtual_memory_safe_pct=None)
        engine.attach(model)
        exclude_output_head(engine, model)  # offload.predict's "offload" keeps the head, as the integrations do
        opt = adamw(model.parameters())
        for i in range(2):
            if i == 1:
                engine.ledger.reset()
            step_fn(model).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    plain = [(r.nbytes, r.shape, r.dtype, r.module, r.decision, r.reason, r.tier, r.copy_bytes)
             for r in engine.ledger.records]
    captured = capture(model_fn, step_fn, strategy="offload", optimizer=adamw, fake=True)
    assert plain and captured.records == plain


def _memtracker_peak(model_fn, step_fn, strategy: str) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    from offload.predict._strategies import apply_strategy

    model = model_fn()
    apply_strategy(model, strategy, None)
    opt = adamw(model.parameters())
    step_fn(model).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with MemTracker() as mt:
        mt.track_external(model, opt)
        step_fn(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("strategy", ["none", "ac"])
@pytest.mark.parametrize("name", ["toy_llama", "batchnorm", pytest.param("hf_llama", marks=pytest.mark.slow)])
def test_predicted_peak_matches_memtracker(name, strategy):
    """Predicted peak (exact bytes, as MemTracker counts CPU tensors) is within 2% of MemTracker's real peak."""
    model_fn, step_fn = CASES[name]()
    measured = _memtracker_peak(model_fn, step_fn, strategy)
    cap = capture(model_fn, step_fn, strategy=strategy, optimizer=adamw, fake=True)
    predicted = replay(cap.trace, DeviceMemory(round_bytes=1)).peak_bytes
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def _at_forward_end(trace) -> tuple[int, int]:
    """(device bytes in use, bytes copied to the host and not back) when backward starts."""
    from offload.predict._trace import Copy, Kernel

    items = trace.items
    end = next(i for i, it in enumerate(items) if type(it) in (Kernel, Copy) and it.phase == "backward")
    moved = sum(it.nbytes if it.direction == "d2h" else -it.nbytes for it in items[:end] if type(it) is Copy)
    return replay(items[:end]).in_use_bytes, moved


def _memtracker_peak_with_gradients_allocated(model_fn, step_fn, strategy: str) -> tuple[int, int]:
    """MemTracker's peak of a step whose gradients exist before it (zeroed in place, as the bench's loop has
    them; no optimizer), and the gradients' bytes."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from offload.predict._strategies import apply_strategy

    model = model_fn()
    apply_strategy(model, strategy, None)
    step_fn(model).backward()
    for p in model.parameters():
        p.grad.zero_()
    with MemTracker() as mt:
        mt.track_external(model)
        step_fn(model).backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], grads


@pytest.mark.parametrize("strategy", ["none", "ac"])  # (offloads: on CPU MemTracker counts the host copies too)
def test_peak_with_gradients_allocated_before_the_step_matches_memtracker(strategy):
    """With every gradient allocated before the step, the peak is the most the predicted step holds besides its
    gradients at any one moment, plus all of them (DeviceMemory.peak_allocated_bytes_less_gradients): within 2% of
    MemTracker's. The H200 comparison topped up the predicted peak with the gradients missing there instead, which
    comes late in backward under checkpointing: `ac` read 0.93x of measured, this 0.99x."""
    model_fn, step_fn = CASES["toy_llama"]()
    measured, grads = _memtracker_peak_with_gradients_allocated(model_fn, step_fn, strategy)
    cap = capture(model_fn, step_fn, strategy=strategy, fake=True)
    mem = replay(cap.trace, DeviceMemory(round_bytes=1))
    predicted = mem.peak_allocated_bytes_less_gradients + grads
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)
    old = mem.peak_allocated_bytes + grads - mem.breakdown_at_peak()["gradient"]  # the top-up at the peak
    assert old < measured - 0.02 * measured  # misses what was live before most gradients existed


def test_transformer_engine_identity():
    """Where the step without offload peaks (the end of forward), device bytes with offload plus the bytes
    offloaded are within 10% of that peak; and offloading lowers the step's peak."""
    model_fn, _ = toy(n_layers=6, dim=64, max_seq_len=256)

    def step_fn(model: nn.Module) -> torch.Tensor:  # activations well above the parameters
        tokens = torch.randint(0, 128, (4, 256))
        return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

    none_cap = capture(model_fn, step_fn, strategy="none")
    none_peak = replay(none_cap.trace).peak_bytes
    none_end, _ = _at_forward_end(none_cap.trace)
    assert none_end >= 0.95 * none_peak, "the model's peak is not at the end of forward: pick another model"
    off_cap = capture(model_fn, step_fn, strategy="offload")
    device, moved = _at_forward_end(off_cap.trace)
    assert moved > 0.5 * none_peak
    assert abs(device + moved - none_peak) <= 0.10 * none_peak, (device, moved, none_peak)
    assert replay(off_cap.trace).peak_bytes < 0.5 * none_peak


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)[torch.nonzero(x > 0, as_tuple=True)].sum()


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _DataDependent()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_data_dependent_shape_names_the_op_and_the_module():
    """A data-dependent shape gets a PredictError naming the op and the module that ran it."""
    with pytest.raises(PredictError, match=r"nonzero.*_Outer\.inner"):
        predict_step(_Outer, lambda m: m(torch.randn(4, 8)), gpu="h100-sxm", strategy="none")


def test_item_in_step_names_the_op():
    """Reading a value on the host (.item()) in the step gets a PredictError naming the op."""
    def step(m: nn.Module) -> torch.Tensor:
        loss = F.mse_loss(m(torch.randn(4, 8)), torch.zeros(4, 8))
        if loss.item() > 0:
            return loss
        return loss

    with pytest.raises(PredictError, match="_local_scalar_dense"):
        predict_step(lambda: nn.Linear(8, 8), step, gpu="h100-sxm", strategy="none")
