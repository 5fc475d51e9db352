"""The lean pack path (issue 12 item 16): cheaper hooks that record and decide exactly as before.

The pack hook logs decisions instead of summing them under a lock (NOTE
[ Ledger logs ]), keeps tensors with a tuple handle tied to a per-step
``_Step`` instead of an object with ``__del__``, memoizes the storages of the
running modules' parameters and buffers per step, and loads nothing ahead on a
synchronous backend. Each test pins one of those changes to the property it
must keep.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.nn.functional as F
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from offload import OffloadActivations
from offload.ledger import Ledger, PackRecord

from offload_testkit import (
    TINY,
    ToyLlama,
    assert_pack_matches_general,
    assert_reconciles,
    assert_same_grads,
    cpu_ctx,
    make_batch,
    no_gc,
    pack_case_strategies,
    require_native,
    twin_of,
)


def _toy() -> ToyLlama:
    torch.manual_seed(0)
    return ToyLlama(TINY)


def _loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())


def test_records_built_from_logged_tuples_are_plain_and_stable():
    """Kept decisions logged as tuples read back as PackRecords: tuple shapes, stable identity, serializable."""
    model = _toy()
    ctx = cpu_ctx(min_offload_size=4096)
    with ctx:
        loss = _loss(model, make_batch(TINY, 2, 16, seed=0))
    loss.backward()
    recs = list(ctx.ledger.records)
    assert recs and all(type(r) is PackRecord for r in recs)
    kept = [r for r in recs if r.decision == "kept"]
    assert kept and all(type(r.shape) is tuple for r in recs)
    again = list(ctx.ledger.records)
    assert all(a is b for a, b in zip(recs, again)), "a record must be built once, not per read"
    json.dumps(ctx.ledger.to_dict())
    yaml.safe_dump([r.shape for r in recs])  # a torch.Size would not be yaml-safe
    assert [r.seq for r in recs] == sorted(r.seq for r in recs)
    assert_reconciles(ctx.ledger.summary())


def test_totals_mid_step_include_the_open_logs():
    """totals() during a step counts the decisions logged so far; close_step then counts them exactly once."""
    model = _toy()
    ctx = cpu_ctx()
    with ctx:
        loss = _loss(model, make_batch(TINY, 2, 16, seed=0))
    mid = ctx.ledger.summary()
    assert mid["packed_count"] == len(ctx.ledger.records) > 0 and mid["steps"] == 0
    loss.backward()
    after = ctx.ledger.summary()
    assert after["steps"] == 1
    for k in ("packed_count", "packed_bytes", "offloaded_bytes", "kept_bytes", "unique_bytes", "d2h_bytes"):
        assert after[k] == mid[k], (k, mid[k], after[k])
    assert ctx.ledger.step_totals[-1].packed_count == mid["packed_count"]


def test_ledger_logs_reconcile_under_concurrent_appends_and_closes():
    """Packs racing close_step on another thread are each counted once, in some step."""
    led = Ledger(max_records=10)
    n_threads, per = 4, 3000
    stop = threading.Event()

    def writer(k: int) -> None:
        for i in range(per):
            rec = (i, 0, 3, torch.Size([1]), "torch.float32", "cpu", "", "kept", "too_small", 0, 0)
            led.log_kept("too_small", 3)
            led.records_log.append(rec)
            led._open_used = True

    def closer() -> None:
        while not stop.is_set():
            led.close_step()

    c = threading.Thread(target=closer)
    c.start()
    ws = [threading.Thread(target=writer, args=(k,)) for k in range(n_threads)]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    stop.set()
    c.join()
    led.close_step()
    s = led.summary()
    assert s["kept_count"] == n_threads * per and s["kept_bytes"] == 3 * n_threads * per
    assert s["packed_count"] == s["kept_count"]


def test_forward_only_steps_close_while_an_old_graph_is_retained():
    """A graph kept alive from an earlier step (retain_graph) does not stop forward-only steps from closing."""
    model = _toy()
    batch = make_batch(TINY, 2, 16, seed=0)
    ctx = cpu_ctx()
    with ctx:
        kept_loss = _loss(model, batch)
    kept_loss.backward(retain_graph=True)  # step 0 closed; its graph (and handles) still alive
    assert ctx.ledger.steps_closed == 1
    with torch.no_grad():
        pass
    for _ in range(3):  # evaluation with grad on: forward only, graph dropped at once
        with ctx:
            out = _loss(model, batch)
        del out
    with ctx:  # the outermost enter closes the previous forward-only step
        pass
    assert ctx.ledger.steps_closed == 4, ctx.ledger.steps_closed
    kept_loss.backward()  # the retained graph still works, bitwise
    assert_reconciles(ctx.ledger.summary())


def test_handles_of_a_freed_graph_die_with_it():
    """Kept and offloaded handles hold the step only: dropping the graph frees the step and the host copies."""
    model = _toy()
    ctx = cpu_ctx(min_offload_size=4096)
    with no_gc():
        with ctx:
            loss = _loss(model, make_batch(TINY, 2, 16, seed=0))
        assert ctx._step_ref() is not None and ctx.pool.in_use_bytes > 0
        del loss
        assert ctx._step_ref() is None and ctx.pool.in_use_bytes == 0


def test_sync_backend_loads_nothing_ahead_by_default():
    """Synchronous copies cannot overlap compute: the default prefetch is off there; an explicit one is honoured."""
    model = _toy()
    batch = make_batch(TINY, 2, 16, seed=0)
    ref = twin_of(model)
    _loss(ref, batch).backward()
    for prefetch, want_ahead in ((None, False), (1 << 20, True)):
        m = twin_of(model)
        ctx = cpu_ctx(prefetch_bytes=prefetch)
        ahead = [0]
        inside = [False]
        orig_load, orig_pre = ctx._load, ctx._sched.ahead

        def load(hc, rec):
            ahead[0] += inside[0]
            return orig_load(hc, rec)

        def pre(p, load_fn):
            inside[0] = True
            try:
                return orig_pre(p, load_fn)
            finally:
                inside[0] = False

        ctx._load, ctx._sched.ahead = load, pre
        with ctx:
            loss = _loss(m, batch)
        loss.backward()
        assert_same_grads(ref, m)
        assert (ahead[0] > 0) == want_ahead, (prefetch, ahead[0])
        assert (ctx.prefetch_budget > 0) == want_ahead
        assert ctx.ledger.step_totals[-1].h2d_bytes > 0


class _WithTable(nn.Module):
    """A Linear (then tanh, which saves its output, with ``tanh=True``), then a product with a
    buffer (a RoPE-like table) that its matmul saves."""

    def __init__(self, tanh: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("table", torch.randn(64, 64))
        self.tanh = tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (torch.tanh(h) if self.tanh else h) @ self.table


def test_running_module_buffer_found_after_its_storage_changes():
    """A buffer replaced by a new storage between steps (FSDP2 re-gathers, re-registered tables) is still kept."""

    m = _WithTable()
    ctx = OffloadActivations(device="cpu", min_offload_size=0)
    x = torch.randn(8, 64, requires_grad=True)
    for _ in range(3):
        m.table = torch.randn(64, 64)  # a new storage every step
        with ctx:
            y = m(x)
        y.sum().backward()
        table_ptr = m.table.untyped_storage().data_ptr()
        hits = [r for r in ctx.ledger.records if r.storage_key == table_ptr and r.step == ctx.ledger.current_step - 1]
        assert hits and all(r.reason == "buffer" for r in hits), [(r.reason, r.shape) for r in hits]


def test_parameter_saved_as_is_is_kept_as_parameter():
    """``x * self.w`` saves the Parameter itself: kept, reason parameter, never copied."""

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4096))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x) * self.w

    m = Scale()
    ctx = OffloadActivations(device="cpu", min_offload_size=0)
    x = torch.randn(4096, requires_grad=True)
    with ctx:
        y = m(x)
    y.sum().backward()
    wptr = m.w.untyped_storage().data_ptr()
    mine = [r for r in ctx.ledger.records if r.storage_key == wptr]
    assert len(mine) == 1 and mine[0].reason == "parameter" and mine[0].copy_bytes == 0
    assert ctx.ledger.step_totals[-1].kept_by_reason.get("parameter") == 4096 * 4


def test_activations_with_history_skip_the_module_walk(monkeypatch):
    """Only a leaf can live on a parameter's or buffer's storage (a parameter's view is caught
    through ``_base``): a saved activation with autograd history is never looked up among the
    running modules' storages, while a buffer saved in the same forward is still found and kept."""

    asked = []
    m = _WithTable(tanh=True)
    ctx = OffloadActivations(device="cpu", min_offload_size=0)
    real = ctx._running_owner  # the engine's owner(ptr), made once (_packing._owner_lookup)
    monkeypatch.setattr(ctx, "_running_owner", lambda ptr: asked.append(ptr) or real(ptr))
    x = torch.randn(8, 64)  # a leaf input: asked about, like the table
    with ctx:
        y = m(x)
    y.sum().backward()
    recs = ctx.ledger.records
    table_ptr = m.table.untyped_storage().data_ptr()
    assert [r.reason for r in recs if r.storage_key == table_ptr] == ["buffer"]
    moved = [r for r in recs if r.decision == "offloaded"]
    assert len(moved) >= 2, [(r.reason, r.shape) for r in recs]  # x, and tanh's output (with history)
    assert sorted(asked) == sorted({x.untyped_storage().data_ptr(), table_ptr}), (len(asked), len(recs))


def test_pool_replays_a_repeated_step_without_arena_work(monkeypatch):
    """A pure step (takes, then gives) repeated: each take gets the range the previous step's take
    of the same index had, with no arena carve; the first take that differs returns every parked
    range to the arena before carving, so it reuses that memory instead of growing the pool."""
    from offload.pool import HostPool, _Arena

    pool = HostPool(pin=False)

    def step(sizes):
        bufs = [pool.take(n) for n in sizes]
        ptrs = [b.tensor.data_ptr() for b in bufs]
        for b in reversed(bufs):
            pool.give(b)
        pool.trim()
        return ptrs, bufs

    step([50_000])  # step 1 (and its re-layout): one chunk that every later step fits in
    p2, _ = step([10_000, 30_000])
    allocs = pool.stats()["allocations"]
    carve = _Arena.carve
    calls = []
    monkeypatch.setattr(_Arena, "carve", lambda self, span: calls.append(span) or carve(self, span))
    p3, old = step([10_000, 30_000])
    assert p3 == p2 and calls == []
    with pytest.raises(RuntimeError, match="already given back"):
        pool.give(old[0])  # a spent handle cannot free the range the next step will replay
    p4, again = step([10_000, 30_000])
    assert p4 == p2 and calls == [] and again[0] is not old[0] and again[0].tensor.numel() == 10_000
    step([40_000])  # fits only in the two ranges merged: they must be back in the arena
    assert calls == [40_000 + (-40_000 % 64)]
    st_ = pool.stats()
    assert st_["allocations"] == allocs and st_["in_use_bytes"] == 0
    assert st_["received_bytes"] == 50_000 + 3 * 40_000 + 40_000
    pool.clear()
    assert pool.stats()["chunks"] == 0


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 3), st.lists(st.tuples(st.booleans(), st.integers(1, 200_000)),
                                                            min_size=1, max_size=25)), min_size=1, max_size=12),
       pin=st.booleans(), cap=st.sampled_from([None, 1 << 20]))
def test_pool_replay_places_every_buffer_where_the_arena_alone_would(steps, pin, cap):
    """Steps repeated (0-3 extra times) and changed, pure or not, under a cap or not: every take
    lands on the same chunk and offset, and every counter ends equal, with replay and without."""
    from offload.pool import HostPool

    class NoReplay(HostPool):
        replay = False

    pools = [HostPool(pin=pin, capacity_bytes=cap, trim_window=3),
             NoReplay(pin=pin, capacity_bytes=cap, trim_window=3)]
    seen: list[list] = [[], []]
    for repeats, ops in steps:
        for _ in range(1 + repeats):
            for pool, out in zip(pools, seen):
                live = {}
                for k, (is_take, size) in enumerate(ops):
                    if is_take or not live:
                        buf = pool.take(size)
                        out.append(None if buf is None else (buf.chunk.seq, buf.offset))
                        if buf is not None:
                            live[k] = buf
                    else:
                        pool.give(live.pop(sorted(live)[size % len(live)]))
                for buf in live.values():
                    pool.give(buf)
                pool.trim()
    assert seen[0] == seen[1]
    a, b = (p.stats() for p in pools)
    assert a == b, {k: (a[k], b[k]) for k in a if a[k] != b[k]}


def test_sync_copies_are_logged_without_a_lock_and_sum_per_step():
    """Synchronous copies append their seconds and bytes (NOTE [ Ledger logs ]): the step totals
    hold their sums (stall = every synchronous second, peak in flight = the largest D2H copy),
    records get their own seconds, mid-step totals see the open logs, and a close consumes them."""
    led = Ledger()
    recs = [PackRecord(i, 0, 100 * (i + 1), (i + 1,), "float32", "cpu", "", "offloaded", "", i + 1, 400)
            for i in range(3)]
    for i, r in enumerate(recs):
        led.add(r, 0)
        led.add_sync_copy(r, "d2h", 0.5 * (i + 1), 100 * (i + 1))
    led.add_sync_copy(recs[0], "h2d", 0.25, 100)
    assert [r.d2h_s for r in recs] == [0.5, 1.0, 1.5] and recs[0].h2d_s == 0.25
    mid = led.totals()
    assert (mid.d2h_seconds, mid.h2d_seconds, mid.h2d_bytes) == (3.0, 0.25, 100)
    done = led.close_step()
    assert (done.d2h_seconds, done.h2d_seconds, done.stall_seconds) == (3.0, 0.25, 3.25)
    assert done.peak_inflight_bytes == 300 and done.h2d_bytes == 100
    led.add_sync_copy(None, "h2d", 1.0, 7)  # a step with only a reload still closes and counts
    nxt = led.close_step()
    assert nxt is not None and (nxt.h2d_seconds, nxt.h2d_bytes, nxt.d2h_seconds) == (1.0, 7, 0.0)
    tot = led.totals()
    assert (tot.d2h_seconds, tot.h2d_seconds, tot.h2d_bytes, tot.stall_seconds) == (3.0, 1.25, 107, 4.25)


@pytest.fixture(params=["python_wrapper", "c_wrapper"])
def fresh_wrapper(request, monkeypatch):
    """``nn.Module.__call__`` unwrapped, no owners and a fresh install budget (NOTE [ Wrapper
    lifetime ]): earlier tests in the process may have made the wrapper sticky. Each test runs with
    ``_tracked_call`` and with the C wrapper (NOTE [ Module tracking in C ])."""
    import weakref

    from offload import modules as om

    om.uninstall()
    monkeypatch.setattr(om, "_installs", 0)
    monkeypatch.setattr(om, "_owners", weakref.WeakSet())  # owners other tests left alive
    monkeypatch.setattr(om, "_python_wrapper_used", False)
    if request.param == "python_wrapper":
        monkeypatch.setattr(om, "_native_call", None)
    else:
        require_native()
        assert om._native_call is not None
    yield om
    om.uninstall()


def _wrapped(om) -> bool:
    """Whether ``nn.Module.__call__`` is the wrapper this test runs with."""
    return om._installed() is (om._native_call if om._native_call is not None else om._tracked_call)


def test_module_tracking_wraps_call_and_adds_no_global_hook(fresh_wrapper):
    """Module tracking wraps ``nn.Module.__call__`` while a scope is open: no global forward hook
    (which would send every module call in the process through ``_call_impl``'s slow path), names
    as before, a clean stack after an exception inside nested modules, per-thread stacks, and the
    original ``__call__`` back afterwards without undoing someone else's later replacement."""
    from torch.nn.modules import module as torch_module

    om = fresh_wrapper
    original = nn.Module.__call__

    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("inner failure")

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.boom = Boom()

        def forward(self, x, fail=False):
            seen.append(om.current_module_name())
            y = self.lin(x)
            if fail:
                try:
                    self.boom(y)
                except ValueError:
                    seen.append(om.current_module_name())  # back in Outer, not in Boom
            return y

    seen: list[str] = []
    m = Outer()
    names_in_lin = []
    m.lin.register_forward_pre_hook(lambda mod, a: names_in_lin.append(om.current_module_name()))
    with om.track_modules():
        assert _wrapped(om)
        assert not torch_module._global_forward_pre_hooks and not torch_module._global_forward_hooks
        m(torch.randn(2, 4), fail=True)
        assert om.current_modules() == [] and om.current_module_name() == ""
        other: list = []
        t = threading.Thread(target=lambda: other.append((m(torch.randn(2, 4)), om.current_modules())))
        t.start()
        t.join()
        assert other and other[0][1] == []  # the other thread has no scope open: nothing pushed
    # (the other thread's call named nothing: no scope open there)
    assert seen == ["Outer", "Outer", ""] and names_in_lin == ["Outer.lin", ""]
    assert nn.Module.__call__ is original

    def third_party(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    with om.track_modules():
        nn.Module.__call__ = third_party  # replaced while tracking was on
    try:
        assert nn.Module.__call__ is third_party  # not clobbered on exit
    finally:
        nn.Module.__call__ = original


def test_module_wrapper_passes_every_argument_through(fresh_wrapper):
    """The wrapper hands the module's call its arguments as they came: many positional ones (the C
    wrapper forwards its caller's own argument array) and keywords, inside a scope and outside one,
    bound (``module.__call__(...)``) and through ``nn.Module.__call__(module, ...)``."""
    om = fresh_wrapper
    seen: list = []

    class Echo(nn.Module):
        def forward(self, *args, **kwargs):
            seen.append(om.current_module_name())
            return args, kwargs

    echo = Echo()
    args, kwargs = tuple(range(12)), {"a": 1, "b": [2], "c": None}
    with om.track_modules():
        assert om._installed() is (om._tracked_call if om._native_call is None else om._native_call)
        assert echo(*args, **kwargs) == (args, kwargs)
        assert echo.__call__(*args[:3], b=5) == (args[:3], {"b": 5})
        assert nn.Module.__call__(echo, **kwargs) == ((), kwargs)
        assert echo() == ((), {})
    assert seen and all(name for name in seen), seen
    assert echo(*args, **kwargs) == (args, kwargs)  # no scope open


def test_module_wrapper_stays_while_its_owner_lives(fresh_wrapper):
    """NOTE [ Wrapper lifetime ]: an engine re-entered every step wraps ``nn.Module.__call__`` once
    (each wrap changes the type of every module; from CPython 3.13 a class stops being cached after
    1,000 such changes), the wrapper goes when the engine dies, an engine built per step makes it
    sticky after ``_STICKY_AFTER`` wraps, a finalizer never blocks on the lock, and ``uninstall()``
    refuses while a scope is open."""
    import gc

    om = fresh_wrapper
    original = nn.Module.__call__
    assert original is not om._tracked_call and not _wrapped(om)
    model = _toy()
    ctx = OffloadActivations(device="cpu", min_offload_size=0)
    for i in range(10):
        with ctx:
            loss = _loss(model, make_batch(TINY, 2, 16, seed=i))
        assert _wrapped(om)  # stays between steps while ctx lives
        loss.backward()
    assert om._installs == 1  # one type change for ten steps (the old tracking made twenty)
    del ctx, loss
    gc.collect()
    assert nn.Module.__call__ is original  # gone with its last owner

    # A finalizer that finds the lock held (a collection inside a locked section) does not
    # block; the next closing scope removes the wrapper instead.
    ctx = OffloadActivations(device="cpu", min_offload_size=0)
    with ctx:
        _loss(model, make_batch(TINY, 2, 16, seed=0)).backward()
    with om._lock:
        del ctx
        gc.collect()
    assert _wrapped(om)
    with om.track_modules():
        pass
    assert nn.Module.__call__ is original

    # Owners built and freed over and over: sticky after _STICKY_AFTER wraps.
    for i in range(om._STICKY_AFTER + 2):
        ctx = OffloadActivations(device="cpu", min_offload_size=0)
        with ctx:
            _loss(model, make_batch(TINY, 2, 16, seed=i)).backward()
        del ctx
        gc.collect()
    assert om._installs == om._STICKY_AFTER and _wrapped(om)
    with om.track_modules():
        with pytest.raises(RuntimeError, match="scope"):
            om.uninstall()
    om.uninstall()
    assert nn.Module.__call__ is original


def test_pack_hook_pushed_is_the_bound_method_unless_replaced():
    """__enter__ pushes the engine's ``_pack`` itself (no wrapper frame per saved tensor), held by the
    thread's hook stack only while entered: the engine still dies by reference counting alone
    (Rule 10). A replaced ``pack_hook`` (``bench.harness`` tags it for the profiler) is what runs."""
    import weakref

    from offload import _torch_private

    ctx = OffloadActivations(device="cpu", min_offload_size=0, native_hooks=False)  # the Python hook's case
    with ctx:
        top = _torch_private.top_saved_tensors_hooks()
        assert top[0].__self__ is ctx and top[0].__func__ is OffloadActivations._pack
        assert ctx._owns_pack_hook(top[0])
    del top
    seen = []
    original = ctx.pack_hook
    ctx.pack_hook = lambda t, original=original: seen.append(t.shape) or original(t)
    x = torch.randn(64, requires_grad=True)
    with ctx:
        y = x.exp()
    y.sum().backward()
    assert seen and torch.equal(x.grad, x.detach().exp())
    del y
    ctx.pack_hook = original
    with no_gc():
        with ctx:
            z = x.exp()
        z.sum().backward()
        del z
        ref = weakref.ref(ctx)
        del ctx, original
        assert ref() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.complex64])
def test_whole_storage_copies_through_a_typed_view_kept_across_replayed_steps(dtype):
    """A saved tensor that is exactly its storage is copied into a typed view of its host buffer;
    the view comes back with the range when the pool replays the step (no new view per pack), a
    new shape gets a new view, and partial or strided saves still copy their bytes. Loss and
    gradients equal the no-offload twin's bitwise in every step."""
    torch.manual_seed(0)

    def f(x, w):
        h = (x @ w).tanh()  # saves h (whole storage, 2-D)
        g = h[:, 1:] * 2  # a strided view of h: not its whole storage
        out = (h.sin() * h).sum() + (g * g).sum()
        return out.real if out.is_complex() else out

    ctx = OffloadActivations(device="cpu", min_offload_size=0)
    seen = []
    for step, rows in enumerate([8, 8, 8, 12]):
        w = torch.randn(16, 16, dtype=dtype, requires_grad=True)
        x = torch.randn(rows, 16, dtype=dtype, requires_grad=True)
        w2, x2 = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        with ctx:
            loss = f(x, w)
        loss.backward()
        ref = f(x2, w2)
        ref.backward()
        assert torch.equal(loss, ref) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad), step
        seen.append({id(b[2]) for b in ctx.pool._replay if b[2] is not None})
    assert ctx.pool.stats()["reuses"] > 0
    # Steps 2 and 3 repeat step 1: the typed views made in step 2 are the ones step 3 replays.
    assert seen[1] and seen[1] == seen[2], seen


def test_kept_leaf_is_held_as_is_and_kept_history_detached():
    """Rule 10: a kept leaf (a weight saved as is) is held as it is (no grad_fn, no cycle; no detach
    per saved weight), a kept tensor with autograd history through a detached alias; both unpack
    to gradients bitwise equal to the twin's, and the kept saved output dies by reference counting."""
    import gc
    import weakref

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64))
    x = torch.randn(64, requires_grad=True)
    ctx = OffloadActivations(device="cpu", min_offload_size=1 << 40)  # everything kept
    handles = []
    original = ctx._pack
    ctx.pack_hook = lambda t: handles.append(original(t)) or handles[-1]
    with ctx:
        y = x.exp() * w  # exp saves its output (history); mul saves it and w (a leaf)
    held = {id(h[0]) for h in handles}
    assert id(w) in held  # the Parameter itself
    outs = [h[0] for h in handles if h[0] is not w]
    assert outs and all(o.grad_fn is None and o._base is None for o in outs)
    del outs, held
    y.sum().backward()
    w2, x2 = nn.Parameter(w.detach().clone()), x.detach().clone().requires_grad_()
    (x2.exp() * w2).sum().backward()
    assert torch.equal(w.grad, w2.grad) and torch.equal(x.grad, x2.grad)
    with no_gc():
        with ctx:
            z = x.exp()  # its output saved by its own node: held through a detached alias
        ref = weakref.ref(z)
        handles.clear()
        del z
        assert ref() is None  # no cycle: freed without the garbage collector
    gc.collect()


def test_module_names_follow_renames_and_deaths(fresh_wrapper):
    """The pack hook's name lookup (``offload.modules._names``, one dict read per pack) is never
    stale: registering a model that contains an already-named module renames it, and a module that
    dies takes its entry along (a new module that gets its id is named afresh)."""
    import gc

    om = fresh_wrapper

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            seen.append((om.current_module_name(), id(self)))
            return self.lin(x)

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    seen: list[tuple[str, int]] = []
    inner = Block()
    outer = Wrapper(inner)
    x = torch.randn(2, 4)
    with om.track_modules():
        inner(x)  # called on its own: its own root
        inner(x)
    om.register_model(outer)
    with om.track_modules():
        inner(x)  # now named from the registered model
    assert [n for n, _ in seen] == ["Block", "Block", "Wrapper.inner"]

    # A named module dies: its entry goes with it, so a new module reusing its id is named for itself.
    class Other(nn.Module):
        def forward(self, x):
            seen.append((om.current_module_name(), id(self)))
            return x

    seen.clear()
    doomed = Block()
    with om.track_modules():
        doomed(x)
    old_id = seen[-1][1]
    assert om._names.get(old_id) == "Block"
    del doomed
    gc.collect()
    assert old_id not in om._names
    for _ in range(200):  # CPython reuses freed memory: look for a module that landed on old_id
        fresh = Other()
        if id(fresh) == old_id:
            with om.track_modules():
                fresh(x)
            assert seen[-1] == ("Other", old_id)
            break
        del fresh


def test_observer_count_survives_double_removal():
    """The pack hook looks for observers only while any is registered (``_observer_count``); removing
    a handle twice must not count it twice, or a live observer would stop seeing packs."""
    from offload import _observers as eng

    model = _toy()
    ctx = OffloadActivations(device="cpu", min_offload_size=0)
    base = eng._observer_count[0]
    first, second = [], []
    h1 = ctx.add_observer(first.append)
    h2 = eng.add_pack_observer(second.append)
    assert eng._observer_count[0] == base + 2
    h1.remove()
    h1.remove()  # idempotent, as torch's RemovableHandle is
    assert eng._observer_count[0] == base + 1
    with ctx:
        loss = _loss(model, make_batch(TINY, 2, 16, seed=0))
    loss.backward()
    assert not first and second and len(second) == ctx.ledger.summary()["packed_count"]
    with h2:  # a RemovableHandle is a context manager that removes on exit
        pass
    assert eng._observer_count[0] == base


@settings(max_examples=60, deadline=None)
@given(**pack_case_strategies())
def test_inlined_pack_decides_and_records_as_the_general_path(kinds, min_size, excluded, after_head, with_model,
                                                            dtype, in_backward):
    """The pack hook's inlined path (plain tensors) gives every saved tensor the record, reason, kept
    and offloaded totals and unique bytes that the general path (``_pack_other``, through
    ``policy.classify``) gives it, and a handle that unpacks to the same values: the fast path's
    reordered reads and checks change the cost, never the decision."""
    assert_pack_matches_general(kinds, min_size, excluded, after_head, with_model, dtype, in_backward)


def test_module_calls_are_not_tracked_while_a_compilation_runs(fresh_wrapper, monkeypatch):
    """While torch compiles (AOT tracing after Dynamo, export: ``torch.compiler``'s compiling flag, or
    ``is_compiling()`` on a torch without the flag) a module call is the plain call: nothing pushed."""
    om = fresh_wrapper
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(len(om.current_modules()))
            return x

    m = Probe()
    with om.track_modules():
        m(torch.zeros(1))
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True, raising=False)
        m(torch.zeros(1))
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False, raising=False)
        m(torch.zeros(1))
        if om._installed() is om._tracked_call:  # (a torch without the flag never gets the C wrapper)
            monkeypatch.setattr(om, "_compiler", om._CompilingFlag())  # a torch without the flag
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
            m(torch.zeros(1))
    assert seen[:3] == [1, 0, 1] and seen[3:] in ([], [0])


def test_no_c_wrapper_on_a_torch_without_the_compiling_flag(monkeypatch):
    """The C wrapper reads ``torch.compiler._is_compiling_flag`` itself: on a torch without it,
    attaching the extension leaves module tracking to ``_tracked_call``."""
    from offload import modules as om

    monkeypatch.setattr(om, "_native_ext", None)
    monkeypatch.setattr(om, "_native_call", None)
    monkeypatch.setattr(om, "_native_scope", None)
    monkeypatch.delattr(torch.compiler, "_is_compiling_flag", raising=False)

    class Ext:
        def configure_tracking(self, *_):  # pragma: no cover - must not be called
            raise AssertionError("configured on a torch without the flag")

    om.attach_native(Ext())
    assert om._native_call is None and om._native_scope is None


def test_kept_records_leave_the_cycle_collector():
    """A kept decision's logged record holds only ints, strings, a dtype and its shape as a tuple of
    ints, so the cycle collector untracks it (at its first or second pass): the ring of up to max_records records
    never grows the old generation (a torch.Size in each kept one did, and its growth is what
    triggers full collections: one every ~20k kept packs, 130 ms each with torch imported)."""
    import gc

    ctx = cpu_ctx(min_offload_size=1 << 30)
    a = torch.randn(64, requires_grad=True)
    with ctx:
        y = a.exp().sin().sum()
    y.backward()
    gc.collect()
    gc.collect()  # a record examined before its shape tuple goes at the next pass (it still never reaches the old generation)
    logged = [r for r in ctx.ledger._records if type(r) is tuple]
    assert len(logged) >= 2 and not any(gc.is_tracked(r) for r in logged)
    assert all(type(r[3]) is tuple for r in logged)


def test_module_tracking_runs_output_observers_and_the_nested_hooks_watch(fresh_wrapper):
    """With either wrapper: an outermost module call's output goes to ``OUTPUT_OBSERVERS`` (inner calls'
    do not), and a context entered inside an engine is seen at the next module call (NOTE [ Nested hooks ]
    rule 3: one warning naming it)."""
    import warnings

    om = fresh_wrapper
    got = []

    def observe(module, out):
        got.append((type(module).__name__, tuple(out.shape)))

    m = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    om.OUTPUT_OBSERVERS.append(observe)
    try:
        with om.track_modules():
            assert _wrapped(om)
            m(torch.randn(2, 4))
    finally:
        om.OUTPUT_OBSERVERS.remove(observe)
    assert got == [("Sequential", (2, 3))]

    engine = OffloadActivations(device="cpu", min_offload_size=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with engine:
            assert _wrapped(om)
            with torch.autograd.graph.save_on_cpu():
                m(torch.randn(2, 4, requires_grad=True)).sum()
    msgs = [str(w.message) for w in caught if "inside this engine" in str(w.message)]
    assert len(msgs) == 1 and "save_on_cpu" in msgs[0], msgs


def test_a_process_that_used_the_python_wrapper_keeps_it(fresh_wrapper):
    """NOTE [ Module tracking in C ]: once ``_tracked_call`` was installed (the extension attached after
    a scope opened: its scope has no mirror, and a profiler started then keys on its frames), the
    process keeps it, also across uninstalls and with the extension attached since; where it never
    was, the C wrapper is installed, and stays the choice after an uninstall."""
    om = fresh_wrapper
    if om._native_call is None:
        pytest.skip("the C wrapper's choice (this run keeps the Python wrapper)")
    native = om._native_call
    seen: list = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(om.current_module_name())
            return x

    probe = Probe()
    for _ in range(2):
        with om.track_modules():
            assert om._installed() is native
            probe(torch.zeros(1))
        om.uninstall()
    om._native_call = None  # the extension not attached yet
    try:
        with om.track_modules():
            assert om._installed() is om._tracked_call
            probe(torch.zeros(1))
    finally:
        om._native_call = native
    om.uninstall()
    with om.track_modules():
        assert om._installed() is om._tracked_call  # kept, though the extension is attached now
        probe(torch.zeros(1))
    assert seen == ["Probe"] * 4


def test_c_wrapper_compiles_to_one_graph_with_hooked_submodules(fresh_wrapper):
    """Dynamo cannot trace a builtin: with the C wrapper installed it traces the registered polyfill
    (the plain call), so ``fullgraph=True`` compiles a model whose submodule has a forward hook to one
    graph, with the eager result; the compiled call's own modules are not pushed (as under
    ``_tracked_call``)."""
    om = fresh_wrapper
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[2].register_forward_hook(lambda mod, args, out: out * 2)
    x = torch.randn(3, 4)
    with om.track_modules():
        assert _wrapped(om)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        out = compiled(x)
    torch.testing.assert_close(out, model(x))
    assert len(graphs) == 1


def test_module_wrapper_survives_fx_and_shows_modules_to_the_profiler(fresh_wrapper, tmp_path):
    """With either wrapper: ``torch.fx``'s symbolic tracing patches ``nn.Module.__call__`` and restores
    what it read (the wrapper, not the call it wraps), and torch.profiler's Python tracer, which reads
    ``nn.Module.__call__.__code__`` once per process (at its first start) to find module calls among
    frames, names every module (a fresh process, the wrapper installed before that first start)."""
    import json
    import subprocess
    import sys

    om = fresh_wrapper
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    c_wrapper = om._native_call is not None
    with om.track_modules():
        assert _wrapped(om)
        wrapped_code = om._call.__code__ if c_wrapper else om._tracked_call.__code__
        assert nn.Module.__call__.__code__ is wrapped_code
        torch.fx.symbolic_trace(m)
        assert _wrapped(om)
    script = f"""
import json, sys, torch
from torch import nn
from offload import _native, modules as om
if {c_wrapper}:
    _native.load(announce=False)
m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
with om.track_modules():
    assert (om._installed() is om._native_call) == {c_wrapper}, om._installed()
    with torch.profiler.profile(with_modules=True, with_stack=True) as prof:
        m(torch.randn(2, 4))
prof.export_chrome_trace(sys.argv[1])
"""
    trace = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, "-c", script, str(trace)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"nn.Module: Sequential_0", "nn.Module: Linear_0", "nn.Module: ReLU_0"} <= names


def test_c_wrapper_falls_back_where_dynamo_cannot_take_it(fresh_wrapper, monkeypatch):
    """Where the Dynamo polyfill cannot be registered (an older torch), module tracking stays in
    Python: ``_tracked_call`` is installed and tracks."""
    import torch._dynamo

    om = fresh_wrapper
    if om._native_call is None:
        pytest.skip("the C wrapper's fallback (this run keeps the Python wrapper)")
    monkeypatch.setattr(om, "_native_call", om._native_call)  # (restored after the fallback drops it)
    monkeypatch.setattr(om, "_polyfilled", False)

    def refuse(*args, **kwargs):
        raise TypeError("substitute_in_graph expects a function")

    monkeypatch.setattr(torch._dynamo, "substitute_in_graph", refuse)
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(om.current_module_name())
            return x

    with om.track_modules():
        assert om._installed() is om._tracked_call
        Probe()(torch.zeros(1))
    assert seen == ["Probe"]
