"""The trainer callbacks across runs (issue 35): a second ``trainer.train()`` / ``fit`` with the same
callback keeps the disk tier (its engine was closed at the first run's end), gradients bitwise; the
per-step figures of a new engine (a re-plan) are reported although its step numbers start again."""

from __future__ import annotations

import os

import pytest
import torch

from offload.integrations import _StepReporter


def _one_step(engine) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    with engine:
        loss = model(torch.randn(4, 16)).square().mean()
    loss.backward()


def test_reporter_reports_a_new_engines_step_with_a_number_already_seen():
    """Step 0 of a new engine (a re-plan) after step 0 of the old one is a new step: reported."""
    from offload import OffloadActivations

    reporter = _StepReporter("test", all_figures=False)
    old, new = (OffloadActivations(device="cpu", min_offload_size=0) for _ in range(2))
    _one_step(old)
    assert reporter.new_figures(old) and reporter.new_figures(old) == {}
    _one_step(new)
    assert new.ledger.step_totals[-1].step == old.ledger.step_totals[-1].step == 0
    assert reporter.new_figures(new)["offload/offloaded_bytes"] > 0, "the new engine's step was dropped"
    assert reporter.new_figures(new) == {}


def test_hf_second_train_keeps_the_disk_tier(tmp_path):
    """trainer.train() twice with one OffloadCallback and the disk tier forced: the second run's steps
    go to the disk tier as the first run's did (none kept for want of a host tier), grads bitwise with
    a twin trained twice without offloading; nothing left in disk_dir after each run."""
    pytest.importorskip("transformers")
    from transformers import Trainer

    from test_hf_callback import STEPS, _assert_same_grads, _Data, _GradCapture, _LogRecorder, _args, _model

    from offload.integrations.hf import OffloadCallback

    disk = tmp_path / "spill"
    cb = OffloadCallback(device="cpu", min_offload_size=0, host_budget_bytes=0, disk_dir=str(disk), all_figures=True)
    runs = {}
    for name, callbacks in (("on", [cb]), ("off", [])):
        cap, rec = _GradCapture(), _LogRecorder()
        args = _args(tmp_path, name)
        args.max_steps = 1  # two runs of one step each: the second run is what is checked
        trainer = Trainer(model=_model(), args=args, train_dataset=_Data(), callbacks=[rec, cap, *callbacks])
        for run in range(STEPS):
            trainer.train()
            if callbacks:
                assert not disk.exists() or os.listdir(disk) == [], f"run {run}: files left"
        runs[name] = (cap, rec)
    (cap, rec), (cap_ref, _) = runs["on"], runs["off"]
    _assert_same_grads(cap, cap_ref)  # both runs' steps (STEPS in all)
    logs = [d for d in rec.logs if "loss" in d]
    assert len(logs) == 2 and all(d["offload/disk_bytes"] > 0 for d in logs), logs
    assert not any(d.get("offload/kept_bytes/host_budget") for d in logs), logs


def test_lightning_second_fit_keeps_the_disk_tier(tmp_path):
    """One Lightning OffloadCallback in two fits (two Trainers): the second fit's steps use the disk tier
    (its engine was closed at the first fit's end), grads bitwise with a twin; no file left."""
    pl = pytest.importorskip("lightning.pytorch")
    from test_lightning_callback import _LM, _loader

    from offload.integrations.lightning import OffloadCallback

    disk = tmp_path / "spill"
    cb = OffloadCallback(device="cpu", min_offload_size=0, host_budget_bytes=0, disk_dir=str(disk))
    grads = {}
    for name, callbacks in (("on", [cb]), ("off", [])):
        lm = _LM()
        for _ in range(2):
            trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
            trainer.fit(lm, _loader())
        grads[name] = lm.grads
    assert len(grads["on"]) == len(grads["off"]) == 4
    for g, w in zip(grads["on"], grads["off"]):
        assert g.keys() == w.keys() and all(torch.equal(g[n], w[n]) for n in w)
    steps = cb.engine.ledger.step_totals
    assert len(steps) == 4 and all(t.tiers["disk"]["bytes"] > 0 for t in steps), [t.tiers for t in steps]
    assert not any(t.kept_by_reason.get("host_budget") for t in steps)
    assert not disk.exists() or os.listdir(disk) == []
