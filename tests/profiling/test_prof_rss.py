"""RSSTracker: per-module host RSS deltas, no state on modules, removable hooks."""

from __future__ import annotations

import torch
from torch import nn

from offload import OffloadActivations
from offload.profiling import RSSTracker

from _prof_models import MLP

MiB = 1 << 20


class Grower(nn.Module):
    """Allocates and keeps a 64 MiB tensor on every call: RSS must grow by about that much."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept.append(torch.ones(64 * MiB // 4))  # touched pages: resident
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(4, 4)
        self.grow = Grower()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.grow(self.small(x))


def test_growth_is_attributed_to_the_allocating_module():
    """The module that allocates 64 MiB shows a delta near 64 MiB; its parent includes it."""
    net = Net()
    with RSSTracker(net) as r:
        net(torch.randn(2, 4))
        net(torch.randn(2, 4))
    s = r.summary()
    assert set(s) == {"Net", "Net.small", "Net.grow"}
    assert s["Net.grow"]["calls"] == 2
    assert s["Net.grow"]["min_delta_bytes"] >= 60 * MiB
    assert s["Net.grow"]["delta_bytes"] >= 120 * MiB
    assert s["Net"]["delta_bytes"] >= s["Net.grow"]["delta_bytes"] - 4 * MiB
    assert s["Net.small"]["max_delta_bytes"] < 8 * MiB
    assert s["Net.grow"]["rss_post_forward"] - s["Net.grow"]["rss_pre_forward"] >= 60 * MiB
    t = r.totals()
    assert t["rss_exit"] - t["rss_enter"] >= 120 * MiB and t["peak_rss_seen"] >= t["rss_enter"]
    assert "Net.grow" in r.table()


def test_no_module_attributes_and_hooks_removed(mlp):
    """Nothing is stored on modules; leaving the block (or remove()) takes every hook off."""
    before = {name: set(vars(m)) for name, m in mlp.named_modules()}
    r = RSSTracker(mlp)
    with r:
        assert len(r.handles) == 2 * len(list(mlp.modules()))
        mlp(MLP.batch())
        assert {name: set(vars(m)) for name, m in mlp.named_modules()} == before
    assert r.handles == []
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in mlp.modules())
    assert r.summary()["MLP.1"]["calls"] == 1
    r.reset()
    assert r.summary() == {}


def test_names_match_engine_ledger(toy):
    """Module names are the engine's: every module the ledger recorded appears in the RSS summary."""
    model, tokens, _ = toy
    engine = OffloadActivations(device="cpu")
    with RSSTracker(model) as r:
        with engine:
            loss = model(tokens).float().mean()
    loss.backward()
    recorded = {rec.module for rec in engine.ledger.records if rec.module}
    assert recorded and recorded <= set(r.summary())


def test_pre_post_columns_agree_with_the_delta_columns():
    """rss_post_forward - rss_pre_forward is the largest single-call growth; they were the latest call's
    bounds, equal for a call that grew nothing while delta_bytes summed an earlier call's growth."""

    class OnceGrower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kept: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.kept:
                self.kept.append(torch.ones(64 * MiB // 4))
            return x

    net = nn.Sequential(nn.Linear(4, 4), OnceGrower())
    with RSSTracker(net) as r:
        for _ in range(3):
            net(torch.randn(2, 4))
    for name, s in r.summary().items():
        assert s["rss_post_forward"] - s["rss_pre_forward"] == s["max_delta_bytes"], name
    g = r.summary()["Sequential.1"]
    assert g["delta_bytes"] >= 60 * MiB
    assert g["rss_post_forward"] - g["rss_pre_forward"] >= 60 * MiB
