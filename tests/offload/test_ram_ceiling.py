"""The system RAM ceiling is enforced without a system call per saved tensor (policy.RamCeiling)."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest
import torch

from offload import OffloadActivations
from offload import policy
from offload.policy import RamCeiling

GiB = 1 << 30


class _FakeRam:
    def __init__(self, total: int, used: int) -> None:
        self.total, self.used, self.calls = total, used, 0

    def __call__(self):
        self.calls += 1
        return SimpleNamespace(total=self.total, available=self.total - self.used,
                               percent=100.0 * self.used / self.total)


@pytest.fixture
def fake_ram(monkeypatch):
    ram = _FakeRam(total=100 * GiB, used=50 * GiB)
    monkeypatch.setattr(psutil, "virtual_memory", ram)
    return ram


def test_engine_reads_system_ram_rarely(fake_ram, monkeypatch):
    """500 offloaded tensors under a RAM ceiling read system RAM once, not 500 times."""
    monkeypatch.setattr(policy.time, "monotonic", lambda: 0.0)  # a fast machine: no sample ages out
    ctx = OffloadActivations(device="cpu", min_offload_size=0, virtual_memory_safe_pct=90)
    x = torch.randn(256, requires_grad=True)
    with ctx:
        y = x
        for _ in range(500):
            y = y.sin() * 1.0001  # sin saves its input; mul by a scalar saves nothing
    y.sum().backward()
    s = ctx.ledger.summary()
    assert s["offloaded_count"] >= 500
    assert fake_ram.calls == 1, f"{fake_ram.calls} reads of system RAM for {s['offloaded_count']} offloads"


def test_own_grants_never_pass_the_ceiling_between_samples(fake_ram, monkeypatch):
    """Between samples every granted byte counts as used, so the gauge alone cannot overshoot."""
    clock = [0.0]
    monkeypatch.setattr(policy.time, "monotonic", lambda: clock[0])
    g = RamCeiling(max_age_s=10.0, slack_bytes=100 * GiB)
    granted = 0
    while g.allows(GiB, pct=60):  # ceiling 60 GiB, 50 GiB used at the sample
        granted += GiB
        assert granted <= 10 * GiB
    assert granted == 10 * GiB
    assert fake_ram.calls == 1  # refused from the estimate: a re-check waits max_age_s / 10
    clock[0] += 1.5
    assert g.allows(GiB, pct=60)  # re-read: the grants were pool reuse, RAM did not grow
    assert fake_ram.calls == 2


def test_growth_by_others_seen_after_max_age(fake_ram, monkeypatch):
    """RAM taken by someone else is seen once the sample is older than max_age_s."""
    clock = [0.0]
    monkeypatch.setattr(policy.time, "monotonic", lambda: clock[0])
    g = RamCeiling(max_age_s=0.05)
    assert g.allows(1, pct=60)
    fake_ram.used = 70 * GiB
    clock[0] += 0.01
    assert g.allows(1, pct=60)  # within the documented staleness bound
    clock[0] += 0.05
    assert not g.allows(1, pct=60)
    fake_ram.used = 10 * GiB
    clock[0] += 0.06
    assert g.allows(1, pct=60)


def test_slack_bytes_force_a_new_sample(fake_ram, monkeypatch):
    """Granting more than slack_bytes since the last sample forces a fresh read."""
    monkeypatch.setattr(policy.time, "monotonic", lambda: 0.0)
    g = RamCeiling(max_age_s=10.0, slack_bytes=4 * GiB)
    for _ in range(4):
        assert g.allows(GiB, pct=99)
    assert fake_ram.calls == 1
    assert g.allows(GiB, pct=99)
    assert fake_ram.calls == 2


def test_real_psutil_still_enforced():
    """With real system RAM, a ceiling below current use keeps everything (reason host_budget)."""
    assert psutil.virtual_memory().percent > 0.01
    ctx = OffloadActivations(device="cpu", min_offload_size=0, virtual_memory_safe_pct=0.01)
    x = torch.randn(256, requires_grad=True)
    with ctx:
        y = (x.sin() * x).sum()
    y.backward()
    s = ctx.ledger.summary()
    assert s["offloaded_count"] == 0 and s["kept_count_by_reason"].get("host_budget", 0) >= 1


def test_steady_step_above_the_ceiling_offloads_into_the_held_pool(fake_ram, monkeypatch):
    """The RAM ceiling gates only new host memory (issue 35 item 10): once RAM is above it, a step that
    fits the memory the pool already holds still offloads everything there (no host_budget keeps, no
    new chunk), bitwise; a longer step that would need the pool to grow keeps the excess instead."""
    import copy

    clock = [0.0]
    monkeypatch.setattr(policy.time, "monotonic", lambda: clock[0])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    ref = copy.deepcopy(model)
    ctx = OffloadActivations(device="cpu", min_offload_size=0, virtual_memory_safe_pct=90)

    def step(m, rows, engine=None):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        with engine if engine is not None else torch.enable_grad():
            loss = m(x).square().mean()
        loss.backward()

    step(model, 32, ctx)  # warm-up: the pool grows to the step's size
    fake_ram.used = 95 * GiB  # now above the ceiling
    clock[0] += 1.0  # the next gauge read samples again
    allocations = ctx.pool.stats()["allocations"]
    step(model, 32, ctx)
    t = ctx.ledger.step_totals[-1]
    assert t.offloaded_bytes > 0 and not t.kept_by_reason.get("host_budget"), t.kept_by_reason
    assert ctx.pool.stats()["allocations"] == allocations, "a held-pool step allocated"
    step(model, 4096, ctx)  # needs more than the pool holds: growth is refused, the excess kept
    assert ctx.ledger.step_totals[-1].kept_by_reason.get("host_budget", 0) > 0
    assert ctx.pool.stats()["ram_ceiling_refused"] > 0
    for rows in (32, 32, 4096):
        step(ref, rows)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_disk_staging_above_the_ceiling_reuses_held_staging_and_refuses_new(fake_ram, monkeypatch, tmp_path):
    """Disk staging is new host memory too (issue 35 item 10): above the RAM ceiling a step whose disk
    copies fit the staging the tier already holds still goes to disk; one that would need new staging
    keeps the excess on the device (reason host_budget), counted in the disk stats' ram_ceiling_refused,
    and leaves no file; gradients equal a no-offload twin's bitwise."""
    import copy

    clock = [0.0]
    monkeypatch.setattr(policy.time, "monotonic", lambda: clock[0])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    ref = copy.deepcopy(model)
    ctx = OffloadActivations(device="cpu", min_offload_size=0, virtual_memory_safe_pct=90,
                             host_budget_bytes="16KiB", disk_dir=str(tmp_path / "disk"))

    def step(m, rows, engine=None):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        with engine if engine is not None else torch.enable_grad():
            loss = m(x).square().mean()
        loss.backward()

    def disk():
        ctx.tiers.disk.drain()
        return ctx.tiers.stats()["disk"]

    step(model, 64, ctx)  # warm-up: the pool and the disk tier's staging grow to the step's size
    assert disk()["received_bytes"] > 0
    fake_ram.used = 95 * GiB  # now above the ceiling
    clock[0] += 1.0  # the next gauge read samples again
    before = disk()
    step(model, 64, ctx)
    t, after = ctx.ledger.step_totals[-1], disk()
    assert not t.kept_by_reason.get("host_budget"), t.kept_by_reason
    assert after["received_bytes"] > before["received_bytes"] and after["ram_ceiling_refused"] == 0
    assert after["staging_reserved_bytes"] == before["staging_reserved_bytes"]
    step(model, 4096, ctx)  # needs more staging than the tier holds: refused, the excess kept
    t, last = ctx.ledger.step_totals[-1], disk()
    assert t.kept_by_reason.get("host_budget", 0) > 0, t.kept_by_reason
    assert last["ram_ceiling_refused"] > 0 and last["refused"] >= last["ram_ceiling_refused"]
    assert last["staging_reserved_bytes"] == before["staging_reserved_bytes"]
    for rows in (64, 64, 4096):
        step(ref, rows)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    ctx.close()
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]
