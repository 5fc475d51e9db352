"""Host tiers on a real model (NOTE [ Host tiers ], NOTE [ Disk tier ]): the disk tier forced
(``host_budget_bytes=0``) trains bitwise like no offloading across every lifetime pattern of Rule 1
and leaves no file behind; pin failures, a full or read-only disk and a pageable budget move copies
to the next tier; every copied byte is accounted in exactly one tier."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from offload import OffloadError
from offload.disk import HEADER_BYTES, LOCK_NAME, RUN_PREFIX, DiskTierError

from ._common import (
    CFG,
    assert_grads_equal,
    assert_ledger_consistent,
    engine,
    grads_of,
    make_batch,
    make_model,
    rss_bytes,
    train_step,
    twin,
)

BATCH = make_batch(CFG, 2, 32)


def _disk_engine(tmp_path, **kw):
    kw.setdefault("host_budget_bytes", 0)
    return engine(disk_dir=str(tmp_path), **kw)


def _run_dir(ctx) -> str:
    return ctx.tiers.disk.run_dir


def _tensor_files(ctx) -> list[str]:
    return [n for n in os.listdir(_run_dir(ctx)) if n != LOCK_NAME]


def _no_files_after_gc(ctx, what: str) -> None:
    gc.collect()
    assert _tensor_files(ctx) == [], f"{what}: files left: {_tensor_files(ctx)[:5]}"
    assert ctx.tiers.stats()["disk"]["file_bytes"] == 0, what


def _next_step_bitwise(model, ref, ctx, what: str) -> None:
    """From zeroed grads, one step through ``ctx`` trains bitwise like the twin ``ref`` and leaves no file;
    then the engine is closed."""
    model.zero_grad(set_to_none=True)
    train_step(model, BATCH, ctx)
    train_step(ref, BATCH)
    assert_grads_equal(ref, model, what)
    _no_files_after_gc(ctx, f"{what}: the next step")
    ctx.close()


def assert_tiers_reconcile(ctx) -> None:
    """Every byte copied off the device is in exactly one tier: the ledger's per-tier bytes sum to
    d2h_bytes, and so do the tiers' own counters."""
    s = ctx.ledger.summary()
    assert sum(t["bytes"] for t in s["tiers"].values()) == s["d2h_bytes"], s["tiers"]
    assert ctx.tiers.received_bytes() == s["d2h_bytes"], (ctx.tiers.stats(), s["d2h_bytes"])
    st = ctx.tiers.stats()
    assert s["tiers"]["pool"]["bytes"] == st["pool"]["received_bytes"]
    assert s["tiers"]["pageable"]["bytes"] == st["pageable"]["received_bytes"]
    disk = st["disk"]["received_bytes"] if st["disk"] is not None else 0
    assert s["tiers"]["disk"]["bytes"] == disk
    offloaded = [r for r in ctx.ledger.records if r.decision == "offloaded"]
    assert all(r.tier in ("pool", "pageable", "disk") for r in offloaded), {r.tier for r in offloaded}


def _step_kinds():
    def plain(model, ctx):
        train_step(model, BATCH, ctx)

    def retain_graph(model, ctx):
        tokens, targets = BATCH
        with ctx:
            logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward(retain_graph=True)
        loss.backward()

    def double_backward(model, ctx):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tokens, targets = BATCH
        with sdpa_kernel(SDPBackend.MATH):  # CPU flash attention has no double backward
            with ctx:
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            params = [p for p in model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, params, create_graph=True)
            penalty = sum((g * g).sum() for g in grads)
            (loss + penalty).backward()

    def several_forwards(model, ctx):
        tokens, targets = BATCH
        losses = []
        for i in range(3):
            with ctx:
                logits = model(tokens[:, : 16 + 8 * i])
            losses.append(F.cross_entropy(logits.flatten(0, 1), targets[:, : 16 + 8 * i].flatten()))
        sum(losses).backward()

    def variable_lengths(model, ctx):
        for i, seq in enumerate((8, 40, 17, 64, 24)):
            train_step(model, make_batch(CFG, 2, seq, seed=i), ctx)

    return {f.__name__: f for f in (plain, retain_graph, double_backward, several_forwards, variable_lengths)}


STEPS = _step_kinds()


@pytest.mark.parametrize("kind", list(STEPS))
def test_disk_forced_is_bitwise_and_leaves_no_file(tmp_path, kind):
    """host_budget_bytes=0 + disk_dir: every offloaded tensor goes through a file and back; grads
    bitwise equal the plain step's; no file is left once the graphs are gone; close() removes the
    run directory."""
    step = STEPS[kind]
    model = make_model()
    ref = twin(model)
    ctx = _disk_engine(tmp_path)
    step(ref, contextlib.nullcontext())
    step(model, ctx)
    assert_grads_equal(ref, model, kind)
    s = ctx.ledger.summary()
    assert s["offloaded_count"] > 0 and s["tiers"]["disk"]["count"] == s["tiers"]["disk"]["count"] > 0
    assert s["tiers"]["pool"]["bytes"] == 0 and s["tiers"]["disk"]["bytes"] == s["d2h_bytes"]
    assert s["tiers"]["disk"]["seconds"] > 0
    assert_ledger_consistent(s)
    assert_tiers_reconcile(ctx)
    _no_files_after_gc(ctx, kind)
    run_dir = _run_dir(ctx)
    ctx.close()
    assert not os.path.exists(run_dir) and os.listdir(tmp_path) == []


class _Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [_Boom, KeyboardInterrupt])
def test_exception_mid_forward_leaves_no_file(tmp_path, exc):
    """An exception (or KeyboardInterrupt) raised mid-forward frees the graph: its files go with
    it, and the next step trains bitwise."""
    model = make_model()
    ref = twin(model)
    ctx = _disk_engine(tmp_path)

    def bomb(module, args, out):
        raise exc()

    h = model.layers[1].register_forward_hook(bomb)
    with pytest.raises(exc):
        train_step(model, BATCH, ctx)
    h.remove()
    assert ctx.ledger.summary()["tiers"]["disk"]["count"] > 0, "the first layer went to disk"
    _no_files_after_gc(ctx, "after the exception")
    _next_step_bitwise(model, ref, ctx, "after the exception")


def test_graph_freed_without_backward_leaves_no_file(tmp_path):
    """A forward whose graph is dropped without backward (evaluation with grad on) deletes its files."""
    model = make_model()
    ctx = _disk_engine(tmp_path)
    with ctx:
        out = model(BATCH[0])
    assert _tensor_files(ctx), "the forward wrote files"
    del out
    _no_files_after_gc(ctx, "graph dropped")
    ctx.close()


def test_two_threads_share_one_disk_engine(tmp_path):
    """Two threads train their own model with one engine whose disk tier is forced: both bitwise."""
    ctx = _disk_engine(tmp_path)
    pairs = [(make_model(seed=k), None) for k in range(2)]
    pairs = [(m, twin(m)) for m, _ in pairs]

    def work(k: int) -> None:
        model, ref = pairs[k]
        for i in range(3):
            batch = make_batch(CFG, 2, 16 + 8 * (i + k), seed=10 * k + i)
            train_step(model, batch, ctx)
            train_step(ref, batch)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(work, range(2)))  # both run at once; a failure in either is raised here
    for k, (model, ref) in enumerate(pairs):
        assert_grads_equal(ref, model, f"thread {k}")
    assert_tiers_reconcile(ctx)
    _no_files_after_gc(ctx, "two threads")
    ctx.close()


def test_corrupted_file_raises_a_named_error(tmp_path):
    """Files changed between forward and backward: DiskTierError from backward, never a wrong grad;
    the files still go when the graph is freed."""
    model = make_model()
    ctx = _disk_engine(tmp_path)
    tokens, targets = BATCH
    with ctx:
        logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    ctx.tiers.disk.drain()
    # Every file: backward reads only those whose originals died (a tensor something else keeps alive is not
    # reloaded: NOTE [ Copy schedule ] item 6), and the first file held such a tensor.
    for name in _tensor_files(ctx):
        with open(os.path.join(_run_dir(ctx), name), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(DiskTierError, match="does not hold what was written"):
        loss.backward()
    del loss, logits
    _no_files_after_gc(ctx, "after the error")
    ctx.close()


def test_disk_times_reported_after_the_step_closed_stay_in_that_step(tmp_path):
    """A writer thread reports a write's seconds after the compute thread has read the file back and
    closed the step (the write's state is set first, its time next): the seconds are that step's, and
    no later step is opened by them (a fit of four steps once reported five step totals)."""
    model = make_model()
    ctx = _disk_engine(tmp_path)
    store = ctx.tiers.disk
    report, gate = store._time, threading.Event()
    parked: list[float] = []
    done = threading.Semaphore(0)

    def delayed(kind, seconds, nbytes, rec):
        gate.wait(30)
        parked.append(seconds)
        report(kind, seconds, nbytes, rec)
        done.release()

    def late(kind, seconds, nbytes, rec=None):
        if kind == "write":  # a writer's report, held until the step has closed (the writer goes on)
            threading.Thread(target=delayed, args=(kind, seconds, nbytes, rec), daemon=True).start()
        else:
            report(kind, seconds, nbytes, rec)

    store._time = late
    train_step(model, BATCH, ctx)
    led = ctx.ledger
    assert led.steps_closed == 1 and not parked, "the step closed with every write's report still parked"
    writes = led.step_totals[-1].tiers["disk"]["count"]
    assert writes > 0
    gate.set()
    for _ in range(writes):
        assert done.acquire(timeout=30), "a parked write never reported"
    assert led.close_step() is None, "a write's late report opened a step of its own"
    assert led.steps_closed == 1
    step = led.step_totals[-1]
    assert step.tiers["disk"]["seconds"] >= sum(parked) > 0, "the late seconds belong to the step that wrote"
    assert led.summary()["tiers"]["disk"]["seconds"] == pytest.approx(step.tiers["disk"]["seconds"])
    store._time = report
    ctx.close()


def test_disk_dir_that_is_a_file_is_refused(tmp_path):
    """A disk_dir that exists as a file is refused when the engine is built, naming the setting."""
    f = tmp_path / "not_a_dir"
    f.write_text("")
    with pytest.raises(ValueError, match="disk_dir"):
        engine(disk_dir=str(f))


def _two_steps_warned(model, ref, ctx) -> list[warnings.WarningMessage]:
    """Two steps of different lengths through ``ctx`` and on the twin ``ref``; the warnings ``ctx`` gave."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        train_step(model, BATCH, ctx)
        train_step(model, make_batch(CFG, 2, 24, seed=1), ctx)
    train_step(ref, BATCH)
    train_step(ref, make_batch(CFG, 2, 24, seed=1))
    return w


def test_disk_full_falls_through_with_one_warning(tmp_path, monkeypatch):
    """The disk fills mid-step (ENOSPC from the file system): later copies fall through to the final
    policy (keep) with one warning naming the directory; grads bitwise; nothing left behind."""
    model = make_model()
    ref = twin(model)
    ctx = _disk_engine(tmp_path)
    real = os.posix_fallocate
    calls = [0]

    def filling(fd, off, n):
        calls[0] += 1
        if calls[0] > 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, off, n)

    monkeypatch.setattr(os, "posix_fallocate", filling)
    w = _two_steps_warned(model, ref, ctx)
    assert_grads_equal(ref, model, "disk full")
    full = [x for x in w if "disk tier" in str(x.message)]
    assert len(full) == 1 and _run_dir(ctx) in str(full[0].message), [str(x.message) for x in w]
    s = ctx.ledger.summary()
    assert s["tiers"]["disk"]["count"] == 5 and s["kept_count_by_reason"].get("host_budget", 0) > 0, s
    assert_tiers_reconcile(ctx)
    _no_files_after_gc(ctx, "disk full")
    ctx.close()


def _mlp_lm(seed: int = 0) -> torch.nn.Module:
    """A second, non-Llama model with train_step's interface (tokens -> logits)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(CFG.vocab_size, 48), torch.nn.Linear(48, 96), torch.nn.GELU(),
                               torch.nn.Linear(96, CFG.vocab_size))


_MODELS = {"toy_llama": make_model, "mlp_lm": _mlp_lm}


@pytest.mark.parametrize("kind", list(_MODELS))
def test_deleted_disk_dir_between_steps_is_made_again(tmp_path, kind):
    """disk_dir deleted between steps (a tmp cleaner): the next step's copies still go to disk (the run
    directory made again, counted, one warning that says so and does not blame free space); grads
    bitwise the twin's for every step."""
    disk_dir = tmp_path / "disk"
    model = _MODELS[kind]()
    ref = twin(model)
    ctx = engine(host_budget_bytes=0, disk_dir=str(disk_dir))
    batches = [make_batch(CFG, 2, 16 + 8 * i, seed=i) for i in range(3)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i, batch in enumerate(batches):
            if i:
                shutil.rmtree(disk_dir if i == 1 else _run_dir(ctx))  # disk_dir, then the run directory
            train_step(model, batch, ctx)
            train_step(ref, batch)
            assert_grads_equal(ref, model, f"step {i}")
            step = ctx.ledger.step_totals[-1]
            assert step.tiers["disk"]["count"] > 0 and step.kept_by_reason.get("host_budget", 0) == 0, i
    msgs = [str(x.message) for x in w if "disk tier" in str(x.message)]
    assert len(msgs) == 1 and "was deleted" in msgs[0] and "free space" not in msgs[0], msgs
    assert ctx.tiers.stats()["disk"]["recreated"] == 2
    assert_tiers_reconcile(ctx)
    _no_files_after_gc(ctx, "after the deleted directories")
    ctx.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", list(_MODELS))
def test_files_deleted_before_backward_raise_a_named_error(tmp_path, kind):
    """The run directory deleted between forward and backward (files written, then gone): backward
    raises DiskTierError naming what happened, never a wrong gradient; the step retried at once (no
    garbage collection between) trains bitwise."""
    model = _MODELS[kind]()
    ref = twin(model)
    ctx = _disk_engine(tmp_path)
    tokens, targets = BATCH
    with ctx:
        logits = model(tokens)
    ctx.tiers.disk.drain()
    shutil.rmtree(_run_dir(ctx))
    with ctx, pytest.warns(UserWarning, match="was deleted while the engine was using it"):
        logits = logits + model(tokens)  # copies after the deletion: the directory is made again
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    with pytest.raises(DiskTierError, match="is gone: its run directory was deleted"):
        loss.backward()
    del loss, logits
    _next_step_bitwise(model, ref, ctx, "after the failed backward")


def _mount_tmpfs(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 512 KiB tmpfs (skipped where mounting is not allowed)."""
    path = str(tmp_path / "tmpfs")
    if not _mount_tmpfs(path, "512k"):
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN); the ENOSPC test covers the path")
    yield path
    subprocess.run(["umount", "-l", path], capture_output=True, timeout=10)


def test_tiny_tmpfs_fills_then_falls_through(tiny_tmpfs):
    """A real file system that fills up (512 KiB tmpfs, free-space tracking off by a budget above
    it): the rest falls through with one warning; grads bitwise; files gone after the step."""
    model = make_model()
    ref = twin(model)
    batch = make_batch(CFG, 2, 128)
    ctx = engine(host_budget_bytes=0, disk_dir=tiny_tmpfs, disk_budget_bytes=64 << 20)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        train_step(model, batch, ctx)
    train_step(ref, batch)
    assert_grads_equal(ref, model, "tmpfs full")
    assert len([x for x in w if "disk tier" in str(x.message)]) == 1
    s = ctx.ledger.summary()
    assert s["tiers"]["disk"]["count"] > 0 and s["kept_count_by_reason"].get("host_budget", 0) > 0
    assert_tiers_reconcile(ctx)
    _no_files_after_gc(ctx, "tmpfs full")
    ctx.close()


def test_read_only_mid_run_falls_through(tiny_tmpfs):
    """The disk tier's file system turns read-only mid-run: copies fall through with one warning,
    grads stay bitwise, and the files written before can still be read back."""
    model = make_model()
    ref = twin(model)
    ctx = engine(host_budget_bytes=0, disk_dir=tiny_tmpfs, disk_budget_bytes=64 << 20)
    tokens, targets = make_batch(CFG, 2, 8)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with ctx:
            logits = model(tokens)
            ctx.tiers.disk.drain()
            r = subprocess.run(["mount", "-o", "remount,ro", tiny_tmpfs], capture_output=True)
            if r.returncode != 0:
                pytest.skip(f"cannot remount read-only: {r.stderr!r}")
            logits = logits + model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    ref_logits = ref(tokens) + ref(tokens)
    F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()).backward()
    assert_grads_equal(ref, model, "read-only mid-run")
    msgs = [str(x.message) for x in w if "disk tier" in str(x.message)]
    assert len(msgs) == 1 and "Read-only" in msgs[0], msgs
    subprocess.run(["mount", "-o", "remount,rw", tiny_tmpfs], capture_output=True)
    del loss, logits
    gc.collect()
    train_step(model, (tokens, targets), ctx)  # writable again: the disk tier takes copies again
    assert ctx.tiers.stats()["disk"]["undeleted"] == 0, "files the read-only disk kept are deleted now"
    _no_files_after_gc(ctx, "read-only")
    ctx.close()


_KILLED_STEP = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import torch
    from tests.reliability._common import CFG, engine, make_batch, make_model
    ctx = engine(host_budget_bytes=0, disk_dir={dir!r})
    model = make_model()
    tokens, _ = make_batch(CFG, 2, 32)
    with ctx:
        logits = model(tokens)  # forward done, files written; backward never runs
    ctx.tiers.disk.drain()
    print(ctx.tiers.disk.run_dir, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_sigkill_mid_step_then_new_engine_cleans(tmp_path):
    """A training process SIGKILLed mid-step leaves its run directory; the next engine on the same
    disk_dir deletes it at start, trains bitwise and leaves nothing after close()."""
    code = _KILLED_STEP.format(root=os.getcwd(), dir=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, p.stderr[-2000:]
    left = p.stdout.strip().splitlines()[-1]
    assert os.path.isdir(left) and len(os.listdir(left)) > 1, "the killed step left its files"
    model = make_model()
    ref = twin(model)
    ctx = _disk_engine(tmp_path)
    assert not os.path.exists(left), "the dead run's directory was cleaned at start"
    train_step(model, BATCH, ctx)
    train_step(ref, BATCH)
    assert_grads_equal(ref, model, "after a killed run")
    ctx.close()
    assert [n for n in os.listdir(tmp_path) if n.startswith(RUN_PREFIX)] == []


# -- pin failures and the pageable tier -------------------------------------------------------


@pytest.mark.parametrize("next_tier", ["keep", "pageable", "disk"])
def test_pin_failure_moves_to_the_next_tier(tmp_path, next_tier):
    """ctx.pool.pin = True on a CPU-only machine makes every pinned allocation fail: each request goes
    to the next tier at once (pageable, disk, or kept on the device), counted in pin_failures, one
    warning with the cause and the fix, never a device out-of-memory; grads bitwise."""
    if torch.cuda.is_available():
        pytest.skip("pinning works with CUDA; the GPU variant is in test_host_budget")
    kw = {"pageable": {"pageable_budget_bytes": None}, "disk": {"disk_dir": str(tmp_path)}, "keep": {}}[next_tier]
    ctx = engine(**kw)
    ctx.pool.pin = True
    model = make_model()
    ref = twin(model)
    w = _two_steps_warned(model, ref, ctx)
    assert_grads_equal(ref, model, f"pin failed -> {next_tier}")
    pins = [str(x.message) for x in w if "pinning host memory" in str(x.message)]
    assert len(pins) == 1 and "not a device out-of-memory" in pins[0] and "use_pin_memory=False" in pins[0], pins
    st = ctx.pool.stats()
    assert st["pin_failures"] > 0 and st["received_bytes"] == 0, st
    s = ctx.ledger.summary()
    if next_tier == "keep":
        assert s["offloaded_count"] == 0 and s["kept_count_by_reason"]["host_budget"] > 0
        assert all(r.note == "pin_failed" for r in ctx.ledger.records if r.reason == "host_budget")
    else:
        assert s["tiers"][next_tier]["bytes"] == s["d2h_bytes"] > 0, s["tiers"]
    assert_tiers_reconcile(ctx)
    ctx.close()


def test_pageable_budget_is_a_tier_with_its_own_cap(tmp_path):
    """pool -> pageable (capped) -> disk: each tier holds at most its budget, the copies spread over
    all three, grads bitwise, every byte in exactly one tier."""
    probe = engine()
    train_step(make_model(), BATCH, probe)
    need = probe.pool.stats()["received_bytes"]
    pool_cap, pageable_cap = need // 4, need // 4
    ctx = engine(host_budget_bytes=pool_cap, pageable_budget_bytes=pageable_cap, disk_dir=str(tmp_path))
    model = make_model()
    ref = twin(model)
    peak_pageable = 0

    def watch(ev):
        nonlocal peak_pageable
        peak_pageable = max(peak_pageable, ctx.tiers.stats()["pageable"]["in_use_bytes"])

    ctx.add_observer(watch)
    for i in range(3):
        batch = make_batch(CFG, 2, 32, seed=i)
        train_step(model, batch, ctx)
        train_step(ref, batch)
    assert_grads_equal(ref, model, "three tiers")
    s = ctx.ledger.summary()
    assert all(s["tiers"][t]["count"] > 0 for t in ("pool", "pageable", "disk")), s["tiers"]
    st = ctx.tiers.stats()
    assert st["pool"]["peak_reserved_bytes"] <= pool_cap and 0 < peak_pageable <= pageable_cap, (st, peak_pageable)
    assert st["pageable"]["peak_in_use_bytes"] <= pageable_cap
    assert s["kept_count_by_reason"].get("host_budget", 0) == 0, "the disk tier took the rest"
    assert_tiers_reconcile(ctx)
    ctx.close()


def test_raise_names_every_tier(tmp_path):
    """on_host_budget="raise" with every tier full: OffloadError naming the tiers' settings."""
    ctx = engine(host_budget_bytes=0, pageable_budget_bytes=1, disk_dir=str(tmp_path), disk_budget_bytes=1,
                 on_host_budget="raise")
    with pytest.raises(OffloadError, match="pageable_budget_bytes=1.*disk_budget_bytes=1"):
        train_step(make_model(), BATCH, ctx)
    ctx.close()


def test_pageable_spelling_is_pool_then_pageable():
    """on_host_budget="pageable" (the older spelling) = pageable_budget_bytes=None, then keep."""
    ctx = engine(host_budget_bytes=4096, on_host_budget="pageable")
    assert ctx.tiers.pageable_budget_bytes is None and ctx.tiers.final == "keep"
    assert ctx.tiers.names == ("pool", "pageable")


# -- the long run ---------------------------------------------------------------------------


def run_tiers_long(tmp_path, steps: int, warmup: int) -> None:
    """Pool 25 % of a step, pageable 25 %, the rest on disk; lengths vary every step. Per step:
    bitwise grads, no file left; after warm-up the RSS stays within pinned + pageable budget +
    the writer bound (+ allocator slack), the disk tier's peak file bytes stop growing."""
    seqs = (16, 24, 31, 40, 48, 64)
    probe = engine()
    train_step(make_model(), make_batch(CFG, 2, max(seqs)), probe)
    need = probe.pool.stats()["received_bytes"]
    queue = 64 << 10
    ctx = engine(host_budget_bytes=need // 4, pageable_budget_bytes=need // 4, disk_dir=str(tmp_path),
                 disk_queue_bytes=queue)
    bound = need // 4 + need // 4 + queue
    slack = 48 << 20
    model = make_model()
    ref = twin(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    rng = random.Random(0)
    rss0 = None
    for step in range(steps):
        batch = make_batch(CFG, 2, rng.choice(seqs), seed=step)
        assert torch.equal(train_step(model, batch, ctx), train_step(ref, batch)), step
        got, want = grads_of(model), grads_of(ref)
        for name in want:
            assert torch.equal(got[name], want[name]), f"step {step}: grad of {name}"
        opt.step(), opt_ref.step()
        opt.zero_grad(set_to_none=True), opt_ref.zero_grad(set_to_none=True)
        assert _tensor_files(ctx) == [], f"step {step}: files left"
        if step == warmup - 1:
            gc.collect()
            rss0 = rss_bytes()
        elif step >= warmup:
            grown = rss_bytes() - rss0
            assert grown <= bound + slack, f"step {step}: RSS +{grown} B > tiers' bound {bound} + slack {slack}"
    st = ctx.tiers.stats()
    # Flat: the files never hold more than one (the longest) step's copies.
    headers = HEADER_BYTES * s_count_per_step(ctx)
    assert st["disk"]["peak_file_bytes"] <= need + headers, ("disk bytes grew", st["disk"], need)
    assert st["disk"]["file_bytes"] == 0 and st["disk"]["peak_pending_bytes"] <= max(queue, need)
    s = ctx.ledger.summary()
    assert all(s["tiers"][t]["count"] > 0 for t in ("pool", "pageable", "disk")), s["tiers"]
    assert_ledger_consistent(s)
    assert_tiers_reconcile(ctx)
    ctx.close()
    assert os.listdir(tmp_path) == []


def s_count_per_step(ctx) -> int:
    """The most copies any closed step made."""
    return max(sum(t.tiers.get(n, {}).get("count", 0) for n in t.tiers) for t in ctx.ledger.step_totals)


def test_tiers_long_run_short_ci(tmp_path):
    """40 varying steps over three tiers: bitwise, no file left, RSS and disk bytes bounded."""
    run_tiers_long(tmp_path, 40, warmup=10)


@pytest.mark.slow
def test_tiers_long_run_300_steps(tmp_path):
    """The 300-step version."""
    run_tiers_long(tmp_path, 300, warmup=30)
