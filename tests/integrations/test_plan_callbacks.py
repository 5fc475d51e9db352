"""One line to plan in a trainer (issue 24): ``OffloadCallback(budget_bytes=...)`` in a transformers.Trainer
and a lightning.Trainer plans on the first training step with the trainer's own step, applies the plan,
logs decisions and predicted vs measured peak, re-plans when the sequence grows, gives the same
gradients as training without it, and leaves the model as it was."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import offload

_PLAN_KW = dict(timed=1, bandwidth_gb_s=10.0)
LENGTHS = (16, 32, 32)  # the second batch is longer: a re-plan, whose new engine numbers its first step as
# the first engine numbered its only one (issue 35 item 7: the step reporter must tell them apart)


def _budget(model: torch.nn.Module, step, optimizer) -> int:
    """Half-way between the smallest reachable peak and the no-plan peak of the longest batch, with an optimizer
    like the trainer's (its state is in the budget the callback plans for)."""
    p0 = offload.plan(model, step, budget_bytes=1 << 40, optimizer=optimizer, **_PLAN_KW)
    return p0.min_peak_bytes + (p0.unplanned_peak_bytes - p0.min_peak_bytes) // 2


def _hf_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer a transformers.Trainer builds by default: AdamW over the trainable parameters."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


# -------------------------------------------------------------------- Hugging Face


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)  # use_cache at its default (True), dropout on


class _Seqs(torch.utils.data.IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(1)
        for n in LENGTHS:
            for _ in range(2):
                ids = torch.randint(0, 128, (n,), generator=g)
                yield {"input_ids": ids, "labels": ids}


def _lora_gpt2():
    """The tiny GPT-2 with LoRA on its attention projection (every base weight frozen)."""
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(_gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))


def _hf_train(tmp_path, name: str, callbacks: list, make=_gpt2) -> tuple[torch.nn.Module, list, list]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Grads(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.steps.append([p.grad.clone() for p in model.parameters() if p.requires_grad])

    grads = Grads()
    model = make()
    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=len(LENGTHS), per_device_train_batch_size=2,
                             learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                             seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=_Seqs(), callbacks=[grads, *callbacks])
    trainer.train()
    return model, grads.steps, trainer.state.log_history


def test_hf_callback_plans_applies_replans_and_matches_gradients(tmp_path, caplog) -> None:
    from offload.integrations.hf import OffloadCallback

    probe = _gpt2()
    ids = torch.randint(0, 128, (2, max(LENGTHS)))
    budget = _budget(probe, lambda: probe(input_ids=ids, labels=ids).loss, _hf_optimizer(probe))
    cb = OffloadCallback(budget_bytes=budget, plan_kwargs=_PLAN_KW)
    with caplog.at_level(logging.INFO, logger="offload"):
        model, got, logs = _hf_train(tmp_path, "planned", [cb])
    plain, want, _ = _hf_train(tmp_path, "plain", [])
    assert cb.planner.plans == 2 and cb.planner.planned_shape == (2, 32)  # planned, then re-planned
    assert set(cb.planner.plan.decisions.values()) != {"keep"}
    _planned_with_the_trainers_adamw(cb.planner.plan, model)
    first = [r.getMessage() for r in caplog.records if "under budget_bytes" in r.getMessage()]
    assert len(first) == 2 and "peak predicted" in first[0] and "measured" in first[0]
    assert any("planning again" in r.getMessage() for r in caplog.records)
    assert any(k == "offload/plan_predicted_peak_bytes" for entry in logs for k in entry)
    steps = [entry for entry in logs if "loss" in entry]  # the re-planning step's log too (a new engine)
    assert len(steps) == len(LENGTHS) and all("offload/offloaded_bytes" in entry for entry in steps), steps
    assert len(got) == len(want) == len(LENGTHS)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert torch.equal(a, b)
    # Removed at train end: no wrapped forward left, the KV cache setting as training without a plan leaves it.
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert model.config.use_cache == plain.config.use_cache


def _planned_with_the_trainers_adamw(plan: offload.Plan, model: torch.nn.Module) -> None:
    """The plan holds the trainer's own AdamW (issue 45 item 1): its state, two tensors per trainable
    parameter, is in the budget, and the report's first line says so."""
    opt = plan.cost.optimizer
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert opt.given and opt.name == "AdamW" and opt.state_bytes == 2 * trainable, opt
    assert plan.report().startswith("optimizer AdamW included"), plan.report()
    assert plan.measured_peak_bytes <= plan.budget_bytes


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_hf_callback_plans_a_lora_model_and_says_so(tmp_path) -> None:
    """A PEFT LoRA model plans in the Trainer, with one line when planning starts and one with what it
    chose, both at a level the Trainer's default logging shows; gradients equal training without it."""
    from offload.integrations.hf import OffloadCallback

    probe = _lora_gpt2()
    ids = torch.randint(0, 128, (2, max(LENGTHS)))
    budget = _budget(probe, lambda: probe(input_ids=ids, labels=ids).loss, _hf_optimizer(probe))
    cb = OffloadCallback(budget_bytes=budget, plan_kwargs=_PLAN_KW)
    shown = logging.getLogger("transformers")  # where the Trainer's default logging prints WARNING lines
    lines = _Lines()
    shown.addHandler(lines)
    try:
        _, got, _ = _hf_train(tmp_path, "lora", [cb], make=_lora_gpt2)
    finally:
        shown.removeHandler(lines)
    said = lines.lines
    assert shown.getEffectiveLevel() <= logging.WARNING and shown.handlers  # shown by default
    _, want, _ = _hf_train(tmp_path, "lora_plain", [], make=_lora_gpt2)
    assert cb.planner.plans == 2 and set(cb.planner.plan.decisions.values()) != {"keep"}
    assert sum("planning activation offloading" in m and "training steps" in m for m in said) == 2, said
    assert sum("plan chosen in" in m for m in said) == 2, said
    assert cb.planner.plan.measured_peak_bytes <= cb.planner.plan.budget_bytes
    assert sum("optimizer state included" in m for m in said) == 2, said
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) and all(torch.equal(a, b) for a, b in zip(g, w))


@pytest.mark.parametrize("which", ["hf", "lightning"])
def test_plan_kwargs_typo_named_when_built(which: str) -> None:
    """A misspelt plan_kwargs keyword is refused when the callback is built, with the closest name."""
    if which == "hf":
        from offload.integrations.hf import OffloadCallback
    else:
        pytest.importorskip("lightning.pytorch")
        from offload.integrations.lightning import OffloadCallback
    with pytest.raises(TypeError, match=r"plan_kwargs.*'timd' \(did you mean 'timed'\?\)"):
        OffloadCallback(budget_bytes=1 << 30, plan_kwargs={"timd": 1})


def test_hf_callback_budget_arguments_checked_when_built() -> None:
    from offload.integrations.hf import OffloadCallback

    with pytest.raises(ValueError, match="budget_bytes=-1"):
        OffloadCallback(budget_bytes=-1)
    with pytest.raises(ValueError, match="budget='eighty'"):
        OffloadCallback(budget="eighty")
    with pytest.raises(ValueError, match="exactly one of"):
        OffloadCallback(budget_bytes=1 << 30, budget="50%")
    assert OffloadCallback(budget="80%").planner is not None


def test_budget_share_of_the_device() -> None:
    import psutil

    from offload.integrations._plan import resolve_budget

    total = psutil.virtual_memory().total
    assert resolve_budget("t", None, "50%", torch.device("cpu")) == total // 2
    assert resolve_budget("t", None, 0.25, torch.device("cpu")) == int(0.25 * total)


# -------------------------------------------------------------------- Lightning


def _lightning_module():
    pl = pytest.importorskip("lightning.pytorch")
    from planner_testkit_shim import ToyLlama, ToyLlamaConfig

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = ToyLlama(ToyLlamaConfig(vocab_size=128, dim=64, n_layers=3, n_heads=4, max_seq_len=64))
            self.grads: list = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            self.log("train_loss", loss)
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.grads.append([p.grad.detach().clone() for p in self.parameters()])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return LM()


def _batches():
    g = torch.Generator().manual_seed(2)
    out = []
    for n in LENGTHS:
        x = torch.randint(0, 128, (2, n), generator=g)
        out.append((x, x.roll(-1, 1)))
    return out


def _pl_train(callbacks: list):
    pl = pytest.importorskip("lightning.pytorch")
    lm = _lightning_module()
    trainer = pl.Trainer(max_steps=len(LENGTHS), accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    trainer.fit(lm, torch.utils.data.DataLoader(_batches(), batch_size=None))
    return lm


def test_lightning_callback_plans_applies_replans_and_matches_gradients() -> None:
    from offload.integrations.lightning import OffloadCallback

    probe = _lightning_module()
    x, y = _batches()[-1]
    budget = _budget(probe, lambda: F.cross_entropy(probe.model(x).reshape(-1, 128), y.reshape(-1)),
                     probe.configure_optimizers())
    cb = OffloadCallback(budget_bytes=budget, plan_kwargs=_PLAN_KW)
    got = _pl_train([cb])
    want = _pl_train([])
    assert cb.planner.plans == 2 and cb.planner.planned_shape == (2, 32)
    assert set(cb.planner.plan.decisions) == {f"model.layers.{i}" for i in range(3)}
    assert set(cb.planner.plan.decisions.values()) != {"keep"}
    _planned_with_the_trainers_adamw(cb.planner.plan, got)
    assert len(got.grads) == len(want.grads) == len(LENGTHS)
    for g, w in zip(got.grads, want.grads):
        for a, b in zip(g, w):
            assert torch.equal(a, b)
    assert not any("forward" in m.__dict__ for m in got.modules())
