"""An engine's state outlives nothing it should not and hides nothing (issue 35): a forked child never
deletes the parent's disk-tier files; an engine used after ``close()`` keeps its disk tier; a
read-only ``disk_dir`` falls through; the disk tier shares a storage saved twice like the other
tiers; gradients stay bitwise equal to a no-offload twin throughout."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from offload.disk import RUN_PREFIX

from ._common import CFG, assert_grads_equal, engine, make_batch, make_model, train_step, twin

BATCH = make_batch(CFG, 2, 16)

_FORKS = textwrap.dedent("""
    import gc, multiprocessing as mp, os, sys
    sys.path.insert(0, {root!r})
    import torch, torch.nn.functional as F
    from tests.reliability._common import CFG, assert_grads_equal, engine, make_batch, make_model, train_step, twin
    torch.set_num_threads(1)  # an OpenMP pool used before fork() hangs the child's next parallel op

    def child_exits():  # returns normally: atexit (the store's finalizer before the fix) runs
        sys.exit(0)

    def child_drops():  # closes and frees the engine and the graph it inherited
        global ctx, logits
        ctx.close()
        del ctx, logits
        gc.collect()
        sys.exit(0)

    def child_trains():  # uses the inherited engine: a run directory of its own, grads bitwise
        m = make_model(1)
        r = twin(m)
        train_step(m, batch, ctx)
        train_step(r, batch)
        assert_grads_equal(r, m, "forked child")
        own = ctx.tiers.disk.run_dir
        assert own != parent_run and os.path.isdir(own) and ctx.ledger.step_totals[-1].tiers["disk"]["bytes"]
        sys.exit(0)

    def in_fork(fn):
        pid = os.fork()
        if pid == 0:
            try:
                fn()
            except BaseException as e:
                if isinstance(e, SystemExit):
                    raise
                print("child failed:", repr(e), flush=True)
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, fn.__name__

    def pool():
        with mp.get_context("fork").Pool(2) as p:
            assert p.map(abs, [-1, -2]) == [1, 2]

    batch = make_batch(CFG, 2, 16)
    ctx = engine(host_budget_bytes=0, disk_dir={dir!r})
    for how in (child_exits, child_drops, child_trains, pool):
        model = make_model()
        ref = twin(model)
        tokens, targets = batch
        with ctx:
            logits = model(tokens)
        ctx.tiers.disk.drain()
        parent_run = ctx.tiers.disk.run_dir
        files = sorted(os.listdir(parent_run))
        if how is pool:
            pool()
        else:
            in_fork(how)
        assert sorted(os.listdir(parent_run)) == files, how.__name__ + ": the parent's files changed"
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        train_step(ref, batch)
        assert_grads_equal(ref, model, how.__name__)
        del logits
    ctx.close()
    print("runs left:", [n for n in os.listdir({dir!r}) if n.startswith("offload-")], flush=True)
""")


def test_forked_children_never_delete_the_parents_files(tmp_path):
    """A child made by fork() that exits normally, closes or frees the inherited engine, or trains
    with it (its own run directory), and a fork-started pool, leave the parent's disk-tier files as
    they were: the parent's backward is bitwise; the children's runs are gone when they exit."""
    code = _FORKS.format(root=os.getcwd(), dir=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "runs left: []", p.stdout


def test_engine_used_after_close_keeps_its_disk_tier(tmp_path, caplog):
    """ctx.close() between steps (a trainer's run end), then more steps: the disk tier opens a new run
    directory (logged) and takes the copies again, nothing kept for want of a host tier; bitwise."""
    model = make_model()
    ref = twin(model)
    ctx = engine(host_budget_bytes=0, disk_dir=str(tmp_path))
    train_step(model, BATCH, ctx)
    ctx.close()
    with caplog.at_level(logging.INFO, logger="offload.disk"):
        train_step(model, BATCH, ctx)
    for _ in range(2):
        train_step(ref, BATCH)
    assert_grads_equal(ref, model, "after close")
    step = ctx.ledger.step_totals[-1]
    assert step.tiers["disk"]["bytes"] > 0 and not step.kept_by_reason.get("host_budget"), step
    assert any("opened" in r.getMessage() for r in caplog.records)
    ctx.close()
    assert [n for n in os.listdir(tmp_path) if n.startswith(RUN_PREFIX)] == []


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only file system (a tmpfs remounted ro; skipped where mounting is not allowed)."""
    path = str(tmp_path / "ro")
    os.makedirs(path)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", path], capture_output=True,
                        timeout=10).returncode == 0 if os.geteuid() == 0 else False
    if not ok:
        pytest.skip("cannot mount a read-only tmpfs here; tests/offload/test_disk.py covers the path with EROFS")
    yield path
    subprocess.run(["umount", "-l", path], capture_output=True, timeout=10)


def test_read_only_disk_dir_falls_through(read_only_dir):
    """A read-only disk_dir: the engine is built, one warning names disk_dir, the copies it cannot
    take stay on the device (reason host_budget), grads bitwise; nested missing parents likewise."""
    for disk_dir in (read_only_dir, os.path.join(read_only_dir, "a", "b")):
        model = make_model()
        ref = twin(model)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ctx = engine(host_budget_bytes=0, disk_dir=disk_dir)
            train_step(model, BATCH, ctx)
            train_step(model, BATCH, ctx)
        train_step(ref, BATCH)
        train_step(ref, BATCH)
        assert_grads_equal(ref, model, "read-only disk_dir")
        msgs = [str(x.message) for x in w if "disk tier" in str(x.message)]
        assert len(msgs) == 1 and "disk_dir=" in msgs[0] and "Read-only" in msgs[0], msgs
        s = ctx.ledger.summary()
        assert s["kept_by_reason"]["host_budget"] > 0 and s["tiers"]["disk"]["bytes"] == 0
        assert ctx.tiers.stats()["disk"]["refused_bytes"] > 0
        ctx.close()


def test_disk_tier_shares_a_storage_saved_twice(tmp_path):
    """Rule 7 on the disk tier: a storage saved several times (by two ops, through views) is written
    once, as the pool does it; grads bitwise with both and with no offloading."""

    def run(ctx):
        torch.manual_seed(0)
        w = torch.randn(64, 64, requires_grad=True)
        x = torch.randn(16, 64, requires_grad=True)
        with ctx if ctx is not None else torch.enable_grad():
            h = x @ w
            a = h * h  # h saved twice
            b = a.t().sin()  # a view of a
            loss = (b * b.t().t()).sum() + torch.tanh(h).sum()
        loss.backward()
        return w.grad, x.grad

    pool_ctx = engine()
    disk_ctx = engine(host_budget_bytes=0, disk_dir=str(tmp_path))
    ref, by_pool, by_disk = run(None), run(pool_ctx), run(disk_ctx)
    assert all(torch.equal(r, p) and torch.equal(r, d) for r, p, d in zip(ref, by_pool, by_disk))
    pool_s, disk_s = pool_ctx.ledger.summary(), disk_ctx.ledger.summary()
    assert disk_s["tiers"]["disk"]["count"] == pool_s["tiers"]["pool"]["count"] == pool_s["offloaded_count"]
    assert disk_s["kept_by_reason"]["duplicate_storage"] == pool_s["kept_by_reason"]["duplicate_storage"] > 0
    assert disk_ctx.tiers.stats()["disk"]["count"] == pool_s["offloaded_count"]
    disk_ctx.close()


def test_disk_shared_copy_is_not_used_after_a_hidden_write(tmp_path):
    """A write through .data between two saves (no version bump) is caught on the disk tier too, whether
    the first copy is still staged or already written: the second save gets a copy of its own."""
    for drain in (False, True):
        ctx = engine(host_budget_bytes=0, disk_dir=str(tmp_path))
        w = torch.randn(32, 32, requires_grad=True)
        with ctx:
            h = torch.randn(8, 32, requires_grad=True) * 1.0
            a = h @ w
            if drain:
                ctx.tiers.disk.drain()
            h.data.mul_(2.0)  # invisible to the version counter
            b = h.sin()
        assert ctx.ledger.summary()["kept_by_reason"].get("duplicate_storage", 0) == 0, drain
        del a, b
        ctx.close()


# -- leaving the engine: unmatched, on another thread, misnested (item 9) ---------------------


def _top_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def test_exit_without_enter_is_a_named_error():
    """ctx.__exit__ with no matching __enter__ on this thread (never entered, or entered on another
    thread) raises OffloadError naming the misuse, never PyTorch's internal assert; the engine stays
    usable and its hooks are left where they are."""
    from offload import OffloadError

    ctx = engine()
    with pytest.raises(OffloadError, match="__exit__ without a matching __enter__"):
        ctx.__exit__(None, None, None)
    ctx.__enter__()
    errors = []

    def other_thread():
        try:
            ctx.__exit__(None, None, None)
        except OffloadError as e:
            errors.append(e)

    t = __import__("threading").Thread(target=other_thread)
    t.start()
    t.join()
    assert len(errors) == 1 and "on this thread" in str(errors[0])
    assert ctx._owns_pack_hook(_top_hooks()[0]), "the other thread's exit removed nothing"
    ctx.__exit__(None, None, None)
    assert _top_hooks() is None
    model = make_model()
    ref = twin(model)
    train_step(model, BATCH, ctx)
    train_step(ref, BATCH)
    assert_grads_equal(ref, model, "after the refused exits")


class _Counting(torch.autograd.graph.saved_tensors_hooks):
    """A plain saved-tensor hooks context that counts what it packs (the other context of a misnesting)."""

    def __init__(self) -> None:
        self.packed = 0

        def pack(t):
            self.packed += 1
            return t

        super().__init__(pack, lambda t: t)


def _model_pair(kind: str):
    """Two models (the toy Llama and a plain MLP LM) with train_step's interface."""
    if kind == "toy_llama":
        return make_model()
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(CFG.vocab_size, 48), torch.nn.Linear(48, 96), torch.nn.GELU(),
                               torch.nn.Linear(96, CFG.vocab_size))


def _misnest(ctx, inner) -> None:
    """Enter ``ctx`` then ``inner``, save a tensor, leave ``ctx`` first (it raises), then leave ``inner``."""
    from offload import OffloadError, active_engine

    x = torch.randn(64, 64, requires_grad=True)
    ctx.__enter__()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*entered inside another engine")  # said once; expected here
        inner.__enter__()
    y = x.sin()
    with pytest.raises(OffloadError, match=r"left while a saved-tensor hooks context entered inside it "
                       r"\(.*(_Counting|OffloadActivations)\)"):
        ctx.__exit__(None, None, None)
    assert active_engine() is not ctx, "the misnested exit left the engine"
    before = getattr(inner, "packed", None)
    z = y.cos()  # still inside the inner context: its hooks stay innermost and in effect
    if before is not None:
        assert inner.packed == before + 1, "the inner context's hooks were removed"
    inner.__exit__(None, None, None)
    assert _top_hooks() is None, "the engine's hooks were left on the stack"
    (z.sum()).backward()
    assert torch.equal(x.grad, -torch.sin(x.detach().sin()) * torch.cos(x.detach()))


def test_misnested_exit_leaves_the_engine_and_keeps_the_inner_hooks():
    """Leaving the engine while a context entered inside it is open raises naming it, leaves the engine
    (a second exit is an unmatched one) and keeps the inner context's hooks innermost until it exits."""
    from offload import OffloadError

    ctx = engine()
    _misnest(ctx, _Counting())
    with pytest.raises(OffloadError, match="__exit__ without a matching __enter__"):
        ctx.__exit__(None, None, None)


@pytest.mark.parametrize("kind", ["toy_llama", "mlp_lm"])
@pytest.mark.parametrize("inner_kind", ["hooks", "engine"])
def test_engines_behave_after_a_misnested_exit(kind, inner_kind):
    """After a misnested exit (inside it: plain hooks, or a second engine), the engine and another engine
    train bitwise, record exactly their own steps, and leave nothing entered, tracked or watched on the
    thread."""
    from offload import active_engine
    from offload.modules import _tls

    ctx = engine()
    inner = _Counting() if inner_kind == "hooks" else engine()
    _misnest(ctx, inner)
    other = engine()
    for eng in (ctx, other):
        model = _model_pair(kind)
        ref = twin(model)
        before = eng.ledger.summary()["packed_count"]
        for _ in range(2):
            train_step(model, BATCH, eng)
            train_step(ref, BATCH)
            assert active_engine() is None and _top_hooks() is None and _tls.stack is None
            assert _tls.watch is None, "a left engine still watches module calls"  # (it warned in a later one's name)
        assert_grads_equal(ref, model, f"{kind} after a misnested exit")
        fresh = engine()
        train_step(twin(model), BATCH, fresh)
        s = eng.ledger.summary()
        assert s["packed_count"] - before == 2 * fresh.ledger.summary()["packed_count"] > 0
        assert s["offloaded_count"] > 0
        outside = torch.randn(4, 4, requires_grad=True).sin()  # no engine entered: nothing recorded
        assert eng.ledger.summary()["packed_count"] == s["packed_count"]
        del outside


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_an_engine_is_not_duplicated(tmp_path, how):
    """copy.copy (which silently shared the pool, the disk tier and the ledger), deepcopy and pickle
    of an engine raise a TypeError that says how to build another; the engine is untouched."""
    import copy
    import pickle

    ctx = engine(disk_dir=str(tmp_path))
    dup = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    with pytest.raises(TypeError, match=r"cannot be copied or pickled.*from_config\(ctx.config\)"):
        dup(ctx)
    model = make_model()
    ref = twin(model)
    train_step(model, BATCH, ctx)
    train_step(ref, BATCH)
    assert_grads_equal(ref, model, "after a refused copy")
    ctx.close()


def test_a_subclass_overriding_pack_leaves_cleanly():
    """An engine whose subclass overrides ``_pack`` owns the hooks it pushed: leaving it pops them and no
    engine stays active (the ownership check compared with OffloadActivations._pack and refused it)."""
    import torch

    from offload import OffloadActivations, active_engine

    class Keeping(OffloadActivations):
        def _pack(self, t):
            return (t if t.is_leaf else t.detach(), t._version, self._open_step())

    w = torch.randn(8, 8, requires_grad=True)
    ctx = Keeping(device="cpu")
    for _ in range(2):
        with ctx:
            loss = (w @ w).relu().sum()
        assert active_engine() is None
        loss.backward()
    assert torch.equal(w.grad, 2 * torch.autograd.grad((w @ w).relu().sum(), w)[0])
