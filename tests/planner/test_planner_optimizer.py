"""The optimizer in a plan's budget (issue 45 item 1; NOTE [ Optimizer in the budget ] in
offload/planner/optimizer.py): ``offload.plan(..., optimizer=opt)`` plans for the training step the loop runs,
its optimizer's state and step included, measured and on a target; without one the report says so first."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from planner_testkit import CFG, make_encoder_and_step, make_model_and_step

import offload
from offload._format import format_bytes
from offload.errors import OffloadError
from offload.planner import MemoryMeter
from offload.planner.optimizer import adamw_memory, optimizer_memory
from offload.predict import predict_step

MODELS = [make_model_and_step, make_encoder_and_step]
IDS = ["toy_llama", "encoder"]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _trained_peak(model, step, plan, opt) -> int:
    """Peak of the last of three real training steps with the plan applied: forward, backward, the optimizer's
    step, gradients set to None (as torch's and the HF Trainer's loops do), the optimizer's state counted."""
    handle = plan.apply(model)
    try:
        for _ in range(3):
            meter = MemoryMeter("cpu", [handle.engine.pool, handle.engine.tiers])
            with meter.tracking(model, opt):
                step().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        handle.remove()
    return meter.peak


def _mid(p) -> int:
    return (p.min_peak_bytes + p.unplanned_peak_bytes) // 2


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_a_measured_plan_with_the_optimizer_meets_the_budget_in_real_training(make):
    """A plan made with the loop's AdamW (before its first step: no state yet) keeps real training steps, the
    optimizer's step and state included, within the budget; the plan made without it at the same budget
    does not (the property the optimizer argument exists for)."""
    torch.set_num_threads(1)
    model, step = make()
    budget = _mid(offload.plan(model, step, budget_bytes=1 << 40, timed=1, optimizer=_adamw(model.parameters())))
    with_opt = offload.plan(model, step, budget_bytes=budget, timed=1, optimizer=_adamw(model.parameters()))
    without = offload.plan(model, step, budget_bytes=budget, timed=1)
    assert with_opt.measured_peak_bytes <= budget, with_opt.report()
    assert _trained_peak(model, step, with_opt, _adamw(model.parameters())) <= budget, with_opt.report()
    assert _trained_peak(model, step, without, _adamw(model.parameters())) > budget, without.report()


def _model_fn(make):
    def build():
        model, _ = make()
        return model

    return build


def _step_fn(make):
    if make is make_model_and_step:
        def step(m):
            tokens = torch.randint(0, CFG.vocab_size, (2, 64))
            return F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten())
    else:
        def step(m):
            return m(torch.randn(4, 64, 64)).square().mean()
    return step


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_a_target_plan_with_adamw_fits_predict_step_with_the_same_optimizer(make):
    """A target plan made with AdamW is within the budget by predict_step of the same model with AdamW; the
    plan made without it at the same budget is not."""
    torch.set_num_threads(1)
    model, step = make()
    opt = _adamw(model.parameters())
    probe = offload.plan(model, step, budget_bytes="100%", target="h100-sxm", optimizer=opt, verify=False)
    budget = _mid(probe)
    planned = offload.plan(model, step, budget_bytes=budget, target="h100-sxm", optimizer=opt)
    without = offload.plan(model, step, budget_bytes=budget, target="h100-sxm")

    def predicted(p) -> int:
        return predict_step(_model_fn(make), _step_fn(make), gpu="h100-sxm", strategy=p, optimizer=_adamw).peak_bytes

    assert planned.verified_peak_bytes <= budget, planned.report()
    assert predicted(planned) <= budget, planned.report()
    assert predicted(without) > budget, without.report()


def _real_state_bytes(model, opt) -> int:
    dtype = next(model.parameters()).dtype
    model(torch.randn(2, 16, dtype=dtype)).float().square().mean().backward()
    opt.step()
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps), lambda ps: torch.optim.Adam(ps, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: torch.optim.Adagrad(ps), lambda ps: torch.optim.RMSprop(ps, momentum=0.5)],
    ids=["adamw", "adam_amsgrad", "sgd_momentum", "sgd", "adagrad", "rmsprop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_state_is_derived_before_the_first_step_as_a_real_step_makes_it(make_opt, dtype):
    """Before its first step (no state exists), the derived state is the bytes a real step then allocates,
    for any optimizer and dtype; frozen parameters get none."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(dtype)
    model[0].requires_grad_(False)
    opt = make_opt(model.parameters())
    got = optimizer_memory(opt, model, torch.device("cpu"))
    twin = copy.deepcopy(model)
    assert got.state_bytes == _real_state_bytes(twin, make_opt(twin.parameters()))


def test_foreach_as_on_the_device_adds_the_second_moments_at_once():
    """On a foreach device (CUDA) AdamW's default step copies every second moment at once; per parameter
    (foreach=False) it holds temporaries of one parameter at a time."""
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8)))
    cuda = optimizer_memory(torch.optim.AdamW(model.parameters()), model, torch.device("cuda"))
    loop = optimizer_memory(torch.optim.AdamW(model.parameters(), foreach=False), model, torch.device("cuda"))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert cuda.foreach and cuda.step_bytes >= params and cuda.state_bytes == 2 * params
    assert not loop.foreach and loop.step_bytes <= 3 * largest < params


def test_without_an_optimizer_the_first_line_says_so_and_what_adamw_adds(profiled):
    """A plan made without optimizer= says in its report's first line that optimizer state is not included and
    how much an AdamW over the trainable parameters would add."""
    model, _step, plan = profiled
    first = plan.report().splitlines()[0]
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert "NOT included" in first and "AdamW" in first, first
    assert format_bytes(2 * trainable) in first, first
    assert adamw_memory(model, torch.device("cpu")).state_bytes == 2 * trainable
    assert plan.to_dict()["optimizer"]["given"] is False and plan.cost.optimizer.charged_bytes == 0


def test_a_budget_the_optimizer_alone_exceeds_is_refused_naming_it():
    """A budget below the optimizer's step (its state and temporaries on top of the step's base) is refused
    by name, whatever the decisions."""
    torch.set_num_threads(1)
    model, step = make_model_and_step()
    opt = torch.optim.AdamW(model.parameters())
    probe = offload.plan(model, step, budget_bytes=1 << 40, timed=1, optimizer=opt)
    assert probe.report().splitlines()[0].startswith("optimizer AdamW included")
    opt_step = probe.cost.base + probe.cost.optimizer.step_event_bytes
    assert probe.min_peak_bytes >= opt_step
    with pytest.raises(OffloadError, match=r"budget_bytes=.*cannot be met.*AdamW"):
        offload.plan(model, step, budget_bytes=probe.min_peak_bytes - 1, timed=1, optimizer=opt)


class _Wide(torch.nn.Module):
    """Parameters dominate (a tiny batch): the optimizer's step is the step's peak, whatever the decisions."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


@pytest.mark.parametrize("target", [None, "h100-sxm"], ids=["measured", "target"])
def test_a_budget_below_the_optimizer_step_is_refused_saying_to_lighten_it(target):
    """When the optimizer's step holds the smallest peak (its state and foreach temporaries over the
    parameters and gradients), the refusal names that step and what lightens it, measured and on a target."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, x = _Wide(), torch.randn(1, 2, 256)
    step = lambda: model(x).square().mean()  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    kw = {"target": target} if target else {"timed": 1}
    probe = offload.plan(model, step, budget_bytes="100%" if target else 1 << 40, optimizer=opt, verify=False, **kw)
    with pytest.raises(OffloadError, match=r"AdamW step.*lighten the optimizer.*foreach=False"):
        offload.plan(model, step, budget_bytes=probe.min_peak_bytes - 1, optimizer=opt, **kw)


def test_an_optimizer_argument_that_is_none_of_the_forms_is_refused():
    model, step = make_model_and_step()
    with pytest.raises(TypeError, match=r"optimizer=.*torch.optim.Optimizer"):
        offload.plan(model, step, budget_bytes=1 << 40, optimizer=[object()])
