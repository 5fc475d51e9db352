"""Module names: the fully qualified name in the root model, whichever module is called (issue 9, item 1)."""

from __future__ import annotations

import torch
from torch import nn

from offload import OffloadActivations, current_module_name, track_modules
from offload.modules import module_name, register_model
from offload.profiling import MemProfiler, MemProfilerCfg, PackedBytesTracker, RSSTracker


class EncDec(nn.Module):
    """Two structurally identical children: class-based names merged them as ``Sequential.0``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def _x() -> torch.Tensor:
    return torch.randn(2, 8, requires_grad=True)


def test_same_shaped_children_are_not_merged():
    """encoder.0 and decoder.0 are separate rows in the tracker, the RSS tracker and the MemProfiler."""
    model = EncDec()
    with PackedBytesTracker(model=model) as t, RSSTracker(model) as r:
        model(_x()).sum().backward()
    mods = t.summary()["modules"]
    assert {"EncDec.encoder.0", "EncDec.decoder.0", "EncDec.encoder.1", "EncDec.decoder.1"} <= set(mods)
    assert not any(k.startswith("Sequential") for k in mods)
    assert mods["EncDec.encoder.0"]["logical_bytes"] == 2 * 8 * 4  # x only, not x + decoder's input
    assert {"EncDec.encoder.0", "EncDec.decoder.0"} <= set(r.summary())


def test_memprofiler_modules_section_uses_fqns(tmp_path):
    model = EncDec()
    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir=tmp_path, schedule={"warmup_iters": 0}), model)
    with prof.profile("training_step"):
        model(_x()).sum().backward()
    prof.close()
    end = prof.memory_stats["0.training_step.1.end"]["modules"]
    assert end["EncDec.encoder.0"]["npp_diff"] == end["EncDec.decoder.0"]["npp_diff"] == 2 * 8 * 4


def test_name_is_stable_whichever_submodule_is_called():
    """Calling model.decoder directly still packs under EncDec.decoder.0 once the model is known."""
    model = EncDec()
    t = PackedBytesTracker(model=model)
    with t:
        model.decoder(_x()).sum().backward()
        model(_x()).sum().backward()
    steps = t.steps()
    assert set(steps[0]["modules"]) == {"EncDec.decoder.0", "EncDec.decoder.1"}
    assert {"EncDec.decoder.0", "EncDec.encoder.0"} <= set(steps[1]["modules"])


def test_engine_ledger_uses_the_same_names():
    """The ledger's module field is the registered model's FQN, under a direct submodule call too."""
    model = EncDec()
    register_model(model)
    engine = OffloadActivations(device="cpu", min_offload_size=0)
    with engine:
        y = model.decoder(_x())
    y.sum().backward()
    assert {r.module for r in engine.ledger.records} == {"EncDec.decoder.0", "EncDec.decoder.1"}


def test_wrapper_components_are_dropped():
    """checkpoint_wrapper's and torch.compile's holder attributes do not appear in names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = EncDec()
    model.encoder = checkpoint_wrapper(model.encoder)
    register_model(model)
    inner = model.encoder._checkpoint_wrapped_module[0]
    assert module_name(inner) == "EncDec.encoder.0"

    class Holder(nn.Module):  # what torch.compile's OptimizedModule looks like to named_modules
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self._orig_mod = m

    plain = EncDec()
    held = Holder(plain)
    register_model(held)
    assert module_name(plain.decoder[0]) == "Holder.decoder.0"


def test_fully_shard_keeps_names():
    """FSDP2 swaps classes to FSDP<Class>; the names are those of the unsharded model."""
    import pytest

    pytest.importorskip("torch.distributed.fsdp")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    own = not dist.is_initialized()
    if own:
        import os
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = EncDec()
        fully_shard(model.encoder)
        fully_shard(model)
        assert type(model).__name__ == "FSDPEncDec"
        with PackedBytesTracker(model=model) as t:
            model(_x()).sum().backward()
        assert {"EncDec.encoder.0", "EncDec.decoder.0"} <= set(t.summary()["modules"])
    finally:
        if own:
            dist.destroy_process_group()


def test_unregistered_modules_keep_the_outermost_running_root():
    """Without a registry entry the outermost running module is the root, as before."""
    model = EncDec()
    seen = []
    model.decoder[0].register_forward_pre_hook(lambda m, a: seen.append(current_module_name()))
    with track_modules():
        model(_x())
    assert seen == ["EncDec.decoder.0"]
