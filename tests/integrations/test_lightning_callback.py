"""offload.integrations.lightning.OffloadCallback in a real lightning.Trainer on CPU: grads bitwise, figures logged."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import Logger  # noqa: E402

from offload import active_engine  # noqa: E402
from offload.integrations import FIGURE_KEYS, LOGGED_BY_DEFAULT  # noqa: E402
from offload.integrations.lightning import OffloadCallback  # noqa: E402
from offload_testkit import TINY, ToyLlama, make_batch  # noqa: E402

STEPS = 3


class _LM(pl.LightningModule):
    """A toy Llama whose training_step calls self.model (not self): the callback must not rely on forward hooks."""

    def __init__(self, fail_at: int = -1, calls: int = 1, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ToyLlama(dataclasses.replace(TINY, tie_embeddings=tied))
        self.grads: list[dict[str, torch.Tensor]] = []
        self.fail_at = fail_at
        self.calls = calls  # model calls per training_step (e.g. a chosen and a rejected half)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == self.fail_at:
            raise KeyboardInterrupt
        loss = 0
        for xs, ys in zip(x.chunk(self.calls), y.chunk(self.calls)):
            logits = self.model(xs)
            loss = loss + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1))
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _MemLogger(Logger):
    """Keeps every metrics dict Lightning logs."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict] = []

    @property
    def name(self) -> str:
        return "mem"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append(dict(metrics))


def _loader():
    xs, ys = zip(*(make_batch(TINY, 2, 16, seed=i) for i in range(STEPS)))
    ds = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    return torch.utils.data.DataLoader(ds, batch_size=2, shuffle=False)


def _fit(tmp_path, module, callbacks):
    logger = _MemLogger()
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=logger, callbacks=callbacks,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, default_root_dir=str(tmp_path))
    trainer.fit(module, _loader())
    return logger


def test_lightning_grads_bitwise_and_figures_logged(tmp_path):
    """Every grad of every step is bitwise the run without the callback; figures reach the logger per step."""
    cb = OffloadCallback(device="cpu", min_offload_size=0)
    on, off = _LM(), _LM()
    logger = _fit(tmp_path, on, [cb])
    _fit(tmp_path, off, [])
    assert len(on.grads) == len(off.grads) == STEPS
    for step, (g, w) in enumerate(zip(on.grads, off.grads)):
        assert g.keys() == w.keys() and len(w) > 0
        for name in w:
            assert torch.equal(g[name], w[name]), f"step {step} {name}: grads differ"
    logged = [m for m in logger.metrics if "offload/offloaded_bytes" in m]
    assert len(logged) == STEPS, logger.metrics
    assert all({k for k in m if k.startswith("offload/")} == set(LOGGED_BY_DEFAULT) and m["offload/offloaded_bytes"] > 0
               for m in logged), logged  # by default a short line; every figure with all_figures=True
    s = cb.engine.ledger.summary()
    assert s["offloaded_bytes"] > 0 and s["kept_by_reason"].get("excluded_region", 0) > 0
    assert len(cb.engine.ledger.step_totals) == STEPS
    assert active_engine() is None


def test_keyboard_interrupt_in_training_step_leaves_the_engine(tmp_path):
    """A KeyboardInterrupt inside training_step (Lightning's graceful shutdown) leaves no engine entered."""
    cb = OffloadCallback(device="cpu", min_offload_size=0)
    module = _LM(fail_at=1)
    try:
        _fit(tmp_path, module, [cb])
    except (KeyboardInterrupt, SystemExit):
        pass
    assert active_engine() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("tied", [False, True])
def test_loss_kept_and_a_second_model_call_offloaded_again(tmp_path, tied):
    """The head is excluded as get_act_offloading_ctx_manager does: the loss on its logits stays on the
    device (after_head), and a second model call in the same training_step is offloaded again (a tied
    head is also found from the LightningModule itself, which training_step never calls)."""

    def last_step(cb):
        ledger = cb.engine.ledger
        return [r for r in ledger.records if r.step == ledger.step_totals[-1].step]

    def offloaded_in_blocks(records):
        return sum(1 for r in records if ".layers." in r.module and r.decision == "offloaded")

    one, two = OffloadCallback(device="cpu", min_offload_size=0), OffloadCallback(device="cpu", min_offload_size=0)
    _fit(tmp_path, _LM(calls=1, tied=tied), [one])
    on, off = _LM(calls=2, tied=tied), _LM(calls=2, tied=tied)
    _fit(tmp_path, on, [two])
    _fit(tmp_path, off, [])
    for g, w in zip(on.grads, off.grads):
        for name in w:
            assert torch.equal(g[name], w[name]), name
    records = last_step(two)
    kept_after = [r for r in records if r.reason == "after_head"]
    assert kept_after, "the loss on the logits was offloaded"
    assert not [r for r in kept_after if ".layers." in r.module], sorted({r.module for r in kept_after})
    assert offloaded_in_blocks(records) == 2 * offloaded_in_blocks(last_step(one)) > 0


def test_lightning_disk_tier_figures_logged_and_files_removed(tmp_path):
    """OffloadCallback with the disk tier forced: grads bitwise, per-tier figures logged each step,
    run directory deleted at train end."""
    disk = tmp_path / "spill"
    cb = OffloadCallback(device="cpu", min_offload_size=0, host_budget_bytes=0, disk_dir=str(disk), all_figures=True)
    on, off = _LM(), _LM()
    logger = _fit(tmp_path, on, [cb])
    _fit(tmp_path, off, [])
    for g, w in zip(on.grads, off.grads):
        assert all(torch.equal(g[n], w[n]) for n in w)
    logged = [m for m in logger.metrics if "offload/disk_bytes" in m]
    assert all(set(FIGURE_KEYS) <= m.keys() for m in logged), logged
    assert len(logged) == STEPS and all(m["offload/disk_bytes"] > 0 and m["offload/pool_bytes"] == 0
                                        for m in logged), logged
    assert not disk.exists() or not list(disk.iterdir())
