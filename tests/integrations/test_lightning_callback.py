"""offload.integrations.lightning.OffloadCallback in a real lightning.Trainer on CPU: grads bitwise, figures logged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import Logger  # noqa: E402

from offload import active_engine  # noqa: E402
from offload.integrations import FIGURE_KEYS  # noqa: E402
from offload.integrations.lightning import OffloadCallback  # noqa: E402
from offload_testkit import TINY, ToyLlama, make_batch  # noqa: E402

STEPS = 3


class _LM(pl.LightningModule):
    """A toy Llama whose training_step calls self.model (not self): the callback must not rely on forward hooks."""

    def __init__(self, fail_at: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ToyLlama(TINY)
        self.grads: list[dict[str, torch.Tensor]] = []
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == self.fail_at:
            raise KeyboardInterrupt
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

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
    assert all(set(FIGURE_KEYS) <= m.keys() and m["offload/offloaded_bytes"] > 0 for m in logged)
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
