"""offload.integrations.hf.OffloadCallback in a real transformers.Trainer (and TRL's SFTTrainer) on CPU.

Each test trains the same tiny randomly initialised Llama twice, with and
without the callback, captures every trainable parameter's gradient before
each optimizer step, and compares them bitwise; the ledger's figures must be
in the logged metrics, seen by a callback listed before ours (a stand-in for
the ``report_to`` integrations, which the Trainer runs before user callbacks).
"""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from offload import OffloadConfig  # noqa: E402
from offload.integrations import FIGURE_KEYS, LOGGED_BY_DEFAULT  # noqa: E402
from offload.integrations.hf import OffloadCallback  # noqa: E402
from offload.regions import find_backbone  # noqa: E402

STEPS, BATCH, SEQ, VOCAB = 2, 2, 16, 128


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 2 * STEPS * BATCH) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long)}


class _GradCapture(TrainerCallback):
    """Clones every trainable parameter's gradient before each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor | None]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: None if p.grad is None else p.grad.detach().clone()
                           for n, p in model.named_parameters() if p.requires_grad})


class _LogRecorder(TrainerCallback):
    """Records the logs dict every callback receives (what report_to integrations see)."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def _args(tmp_path, name: str, **kw) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, **kw,
    )


def _assert_same_grads(got: _GradCapture, want: _GradCapture) -> None:
    assert len(got.steps) == len(want.steps) == STEPS
    for step, (g, w) in enumerate(zip(got.steps, want.steps)):
        assert g.keys() == w.keys() and len(w) > 0
        for name, ref in w.items():
            assert ref is not None, f"step {step} {name}: no grad even without offloading"
            assert g[name] is not None and torch.equal(g[name], ref), f"step {step} {name}: grads differ"


def _assert_figures_logged(rec: _LogRecorder, trainer, cb: OffloadCallback) -> None:
    train_logs = [d for d in rec.logs if "loss" in d]
    assert len(train_logs) == STEPS
    want = set(FIGURE_KEYS) if cb._reporter.all_figures else set(LOGGED_BY_DEFAULT)
    for d in train_logs:
        assert want <= {k for k in d if k.startswith("offload/")} <= want | {
            k for k in d if k.startswith("offload/kept_bytes/") and cb._reporter.all_figures}, d
        assert d["offload/offloaded_bytes"] > 0 and d["offload/pool_reserved_bytes"] > 0, d
    hist = [d for d in trainer.state.log_history if "loss" in d]
    assert all(want <= d.keys() for d in hist), hist
    s = cb.engine.ledger.summary()
    assert s["offloaded_bytes"] > 0
    assert s["kept_by_reason"].get("excluded_region", 0) > 0, "the output head / loss tail must be kept"
    assert cb._attached is None, "detached at train end"


def _train(tmp_path, name, model, with_offload, trainer_cls=Trainer, engine_kw=None, **args_kw):
    cap, rec = _GradCapture(), _LogRecorder()
    callbacks = [rec, cap]
    cb = None
    if with_offload:
        cb = OffloadCallback(device="cpu", min_offload_size=0, **(engine_kw or {}))
        callbacks.append(cb)
    trainer = trainer_cls(model=model, args=_args(tmp_path, name, **args_kw), train_dataset=_Data(),
                          callbacks=callbacks)
    trainer.train()
    return trainer, cap, rec, cb


# transformers >= 5.x renamed gradient_checkpointing to activation_checkpointing.
_AC = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ \
    else "gradient_checkpointing"
GC = {
    "no_checkpointing": {},
    "checkpointing_reentrant": {_AC: True, f"{_AC}_kwargs": {"use_reentrant": True}},
    "checkpointing_non_reentrant": {_AC: True, f"{_AC}_kwargs": {"use_reentrant": False}},
    "grad_accumulation": {"gradient_accumulation_steps": 2},  # two forwards per optimizer step
}


def test_every_figure_on_request(tmp_path):
    """OffloadCallback(all_figures=True) logs every figure (FIGURE_KEYS and the kept bytes per reason)
    each step; the default (the other tests here) logs only LOGGED_BY_DEFAULT, a short console line."""
    assert set(LOGGED_BY_DEFAULT) < set(FIGURE_KEYS) and len(LOGGED_BY_DEFAULT) <= 5
    trainer, _, rec, cb = _train(tmp_path, "on", _model(), True, engine_kw={"all_figures": True})
    _assert_figures_logged(rec, trainer, cb)
    assert all(any(k.startswith("offload/kept_bytes/") for k in d) for d in rec.logs if "loss" in d)
    with pytest.raises(TypeError, match="all_figures='yes'"):
        OffloadCallback(all_figures="yes")


@pytest.mark.parametrize("gc", list(GC))
def test_trainer_grads_bitwise_and_figures_logged(tmp_path, gc):
    """Trainer + OffloadCallback: every grad of every step bitwise equal to the run without; figures logged."""
    trainer, cap, rec, cb = _train(tmp_path, "on", _model(), True, **GC[gc])
    _, cap_ref, _, _ = _train(tmp_path, "off", _model(), False, **GC[gc])
    _assert_same_grads(cap, cap_ref)
    _assert_figures_logged(rec, trainer, cb)


@pytest.mark.parametrize("gc", ["no_checkpointing", "checkpointing_reentrant"])
def test_peft_lora_grads_bitwise(tmp_path, gc):
    """A PEFT LoRA model under OffloadCallback: adapter grads bitwise, head found through the PeftModel."""
    peft = pytest.importorskip("peft")

    def lora():
        m = _model()
        return peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0, init_lora_weights=False))

    trainer, cap, rec, cb = _train(tmp_path, "on", lora(), True, **GC[gc])
    _, cap_ref, _, _ = _train(tmp_path, "off", lora(), False, **GC[gc])
    _assert_same_grads(cap, cap_ref)
    assert all("lora_" in n for n in cap.steps[0])
    # The tail (after the body, found through the PeftModel) is kept: head input, loss.
    assert find_backbone(trainer.model) is trainer.model.base_model.model.model
    _assert_figures_logged(rec, trainer, cb)


def _sft(tmp_path, name: str, callbacks: list, **config_kw):
    """Train the tiny Llama with TRL's SFTTrainer (a word-level tokenizer, no download)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                  pad_token="t0", eos_token="t2", unk_token="t1")
    args = trl.SFTConfig(output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=BATCH,
                         learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                         use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
                         max_length=SEQ, **config_kw)
    trainer = trl.SFTTrainer(model=_model(), args=args, processing_class=tok,
                             train_dataset=datasets.Dataset.from_dict({"input_ids": _Data().ids.tolist()}),
                             callbacks=callbacks)
    trainer.train()
    return trainer


def test_trl_sft_trainer_grads_bitwise(tmp_path):
    """TRL's SFTTrainer with OffloadCallback: grads bitwise, figures logged, and its fused LM head
    (which multiplies by lm_head.weight without running the lm_head module) kept on the device."""
    cap, rec, cb = _GradCapture(), _LogRecorder(), OffloadCallback(device="cpu", min_offload_size=0)
    trainer = _sft(tmp_path, "on", [rec, cap, cb])
    cap_ref = _GradCapture()
    _sft(tmp_path, "off", [cap_ref])
    _assert_same_grads(cap, cap_ref)
    _assert_figures_logged(rec, trainer, cb)


@pytest.mark.parametrize("loss_type", ["nll", "chunked_nll"])
def test_trl_sft_trainer_activation_offloading_with_ours_behind_the_flag(tmp_path, recwarn, loss_type):
    """SFTConfig(activation_offloading=True) after offload.compat.trl.patch_sft_trainer() (the documented
    one-line swap): TRL enters our engine around forward *and* backward (training_step); grads bitwise
    against no offloading, the engine offloaded (its ledger), the head's work stayed on the device, and
    remove() gives TRL its own helper back."""
    trl = pytest.importorskip("trl")
    sft_module = __import__("trl.trainer.sft_trainer", fromlist=["get_act_offloading_ctx_manager"])
    if not hasattr(sft_module, "get_act_offloading_ctx_manager"):
        pytest.skip(f"trl {trl.__version__} has no activation_offloading")
    if loss_type not in trl.SFTConfig.__dataclass_fields__["loss_type"].metadata.get("choices", [loss_type]):
        pytest.skip(f"trl {trl.__version__} has no loss_type={loss_type!r}")
    from offload.compat.trl import patch_sft_trainer

    trl_own = sft_module.get_act_offloading_ctx_manager
    with patch_sft_trainer(device="cpu", min_offload_size=0) as patch:
        cap = _GradCapture()
        trainer = _sft(tmp_path, "on", [cap], activation_offloading=True, loss_type=loss_type)
    assert sft_module.get_act_offloading_ctx_manager is trl_own
    cap_ref = _GradCapture()
    _sft(tmp_path, "off", [cap_ref], loss_type=loss_type)
    _assert_same_grads(cap, cap_ref)
    (engine,) = patch.engines
    assert trainer.maybe_activation_offload_context is engine
    s = engine.ledger.summary()
    assert s["offloaded_bytes"] > 0 and s["steps"] >= STEPS, s
    # TRL's fused head multiplies by lm_head.weight without running lm_head: what runs after the
    # body is kept (after_head), and the unused head exclusion is no reason to warn.
    assert s["kept_count_by_reason"].get("after_head", 0) > 0, s["kept_count_by_reason"]
    assert not [w for w in recwarn if "nothing was excluded" in str(w.message)]


def test_patch_sft_trainer_checks_its_settings():
    """Typos and bad values fail when patching, not when the trainer is built."""
    pytest.importorskip("trl")
    from offload.compat.trl import patch_sft_trainer

    with pytest.raises(TypeError, match=r"patch_sft_trainer: .*'min_ofload_size' \(did you mean 'min_offload_size'"):
        patch_sft_trainer(min_ofload_size=0)
    with pytest.raises(ValueError, match="min_offload_size"):
        patch_sft_trainer(min_offload_size=-1)


def test_trl_flag_and_callback_together_warn_once_at_the_users_line(tmp_path):
    """TRL's activation_offloading=True with OffloadCallback added: one warning, at train begin, naming both
    ways to use one engine, attributed to this file (not transformers' callback handler)."""
    trl = pytest.importorskip("trl")
    from offload.compat.trl import patch_sft_trainer

    if "activation_offloading" not in trl.SFTConfig.__dataclass_fields__:
        pytest.skip(f"trl {trl.__version__} has no activation_offloading")
    # TRL's own engine cannot be built on a CPU machine: behind the flag goes ours (the same hooks stacking).
    with patch_sft_trainer(device="cpu"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _sft(tmp_path, "both", [OffloadCallback(device="cpu", min_offload_size=0)], activation_offloading=True)
    hits = [w for w in caught if "activation_offloading" in str(w.message) and "OffloadCallback" in str(w.message)]
    assert len(hits) == 1, [str(w.message)[:120] for w in caught]
    msg = str(hits[0].message)
    assert "activation_offloading=False" in msg and "patch_sft_trainer()" in msg
    assert hits[0].filename == __file__, hits[0].filename


def test_callback_takes_a_config_and_logs_to_the_offload_logger(tmp_path, caplog):
    """OffloadCallback(config=...) works like keywords; per-step lines go to logging 'offload.integrations.hf'."""
    cfg = OffloadConfig(device="cpu", min_offload_size=0)
    cb = OffloadCallback(config=cfg)
    assert cb.config is cfg
    with pytest.raises(TypeError, match="not both"):
        OffloadCallback(config=cfg, device="cpu")
    with pytest.raises(ValueError, match="min_offload_size"):
        OffloadCallback(min_offload_size=-1)
    with caplog.at_level(logging.INFO, logger="offload"):
        trainer = Trainer(model=_model(), args=_args(tmp_path, "cfg"), train_dataset=_Data(), callbacks=[cb])
        trainer.train()
    lines = [r for r in caplog.records if r.name == "offload.integrations.hf" and "offloaded_bytes" in r.getMessage()]
    assert len(lines) == STEPS


def test_interrupt_in_the_tail_does_not_leave_offloading_off():
    """A KeyboardInterrupt while the kept tail runs (head, loss) does not keep the next forward's body
    on the device: the next call closes the stale region, and its body is offloaded again."""
    from offload import active_engine

    model = _model()
    cb = OffloadCallback(device="cpu", min_offload_size=0)
    cb.on_train_begin(None, None, None, model=model)
    ids = _Data().ids[:2]
    fired: list[int] = []

    def interrupt_once(module, args, out):
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt

    model.lm_head.register_forward_hook(interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        model(input_ids=ids, labels=ids)
    cb.engine.close_step()
    model(input_ids=ids, labels=ids).loss.backward()
    t = cb.engine.ledger.step_totals[-1]
    assert t.offloaded_bytes > 0, t.kept_by_reason
    assert t.kept_by_reason.get("excluded_region", 0) > 0
    assert cb.engine._excluded_depth == 0 and active_engine() is None
    cb.on_train_end(None, None, None)
    assert active_engine() is None


@pytest.mark.parametrize("offload", [False, True])
def test_warns_when_transformers_own_checkpoint_offload_shadows_the_engine(offload):
    """transformers >= 5's activation_checkpointing_enable(offload=True) wraps every checkpointed
    layer in save_on_cpu, whose hooks replace ours there: the callback says so, with the fix."""
    model = _model()
    if not callable(getattr(model, "activation_checkpointing_enable", None)):
        pytest.skip(f"transformers {transformers.__version__} has no checkpoint offload")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, offload=offload)
    cb = OffloadCallback(device="cpu", min_offload_size=0)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        cb.on_train_begin(None, None, None, model=model)
    cb.detach()
    ours = [str(w.message) for w in got if "OffloadCallback" in str(w.message)]
    if offload:
        assert len(ours) == 1 and "own checkpoint offload" in ours[0] and "Drop offload=True" in ours[0], ours
    else:
        assert ours == []


def test_disk_tier_figures_logged_and_files_removed(tmp_path):
    """OffloadCallback(host_budget_bytes=0, disk_dir=...): grads bitwise, each step's log has the disk
    tier's bytes and seconds, and train end deletes the run directory."""
    disk = tmp_path / "spill"
    trainer, cap, rec, cb = _train(tmp_path, "on", _model(), True,
                                   engine_kw={"host_budget_bytes": 0, "disk_dir": str(disk), "all_figures": True})
    _, cap_ref, _, _ = _train(tmp_path, "off", _model(), False)
    _assert_same_grads(cap, cap_ref)
    train_logs = [d for d in rec.logs if "loss" in d]
    assert train_logs and all(d["offload/disk_bytes"] > 0 and d["offload/pool_bytes"] == 0 for d in train_logs)
    assert all(d["offload/disk_s"] > 0 for d in train_logs)
    assert not disk.exists() or os.listdir(disk) == [], "train end deletes the disk tier's files"
