"""Engine hardening (issue 12): silent wrong gradients, leaks, crashes and wrong state.

Each test restates one reported defect as the property that must hold; the
docstring names the defect. Gradients are compared bitwise with plain
autograd; leaks are checked with the garbage collector disabled, because a
reference cycle through C++ (a saved output's grad_fn holding its own handle)
is exactly what reference counting cannot free.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload.modules as offload_modules
from offload import NoOpManager, OffloadActivations, active_engine, get_act_offloading_ctx_manager

from offload_testkit import TINY, ToyLlama, assert_reconciles, assert_same_grads, cpu_ctx, make_batch, no_gc, twin_of

INPLACE = "modified by an inplace operation"


def _toy(seed: int = 0, **over) -> ToyLlama:
    torch.manual_seed(seed)
    import dataclasses

    return ToyLlama(dataclasses.replace(TINY, **over))


def _lm_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# -- 1. in-place writes the version check could not see ------------------------------


def _masked_fill_step(a: torch.Tensor) -> torch.Tensor:
    x = a.exp()  # exp saves its result x (version 0)
    x.masked_fill_(a > 0, 0.5)  # ...which is then written in place
    return (x * x).sum()  # x's Python object dies when this returns


@pytest.mark.parametrize("min_size", [0, 1 << 30], ids=["offloaded", "kept"])
def test_inplace_on_dead_temporary_raises_like_autograd(min_size):
    """The in-place error is raised whether or not the saved tensor's Python object survives."""
    a = torch.randn(64, requires_grad=True)
    with pytest.raises(RuntimeError, match=INPLACE):
        _masked_fill_step(a).backward()  # plain autograd
    ctx = cpu_ctx(min_offload_size=min_size)
    with ctx:
        loss = _masked_fill_step(a)
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


def test_inplace_through_surviving_view_after_forward_raises():
    """A write through a view, after forward, to a saved tensor whose own object is gone is caught."""
    a = torch.randn(64, requires_grad=True)
    ctx = cpu_ctx()
    with ctx:
        x = a.exp()
        view = x[:32]
        loss = (x * 2).sum() + x.exp().sum()  # exp saves its result; x saved by nothing else
        del x
    with torch.no_grad():
        view.add_(1.0)  # bumps the shared version counter
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()
    assert ctx.ledger.summary()["offloaded_count"] > 0


# -- 2. dedupe must not share a stale copy -------------------------------------------------


def _two_saves_with_data_write(ctx) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    a = torch.randn(96, requires_grad=True)
    w1 = torch.randn(48, requires_grad=True)
    w2 = torch.randn(48, requires_grad=True)
    with ctx:
        y = a * 2
        o1 = y[:48] * w1  # saves y[:48]: the engine copies all of y's storage
        y.data[48:] = 7.0  # untracked by the version counter
        o2 = y[48:] * w2  # same storage, same version: must not reuse the stale copy
        loss = o1.sum() + o2.sum()
    loss.backward()
    return loss, [a.grad, w1.grad, w2.grad]


def test_dedupe_never_shares_a_copy_made_before_an_untracked_write():
    """A write through ``.data`` between two saves of one storage: grads equal plain autograd."""
    _, want = _two_saves_with_data_write(contextlib.nullcontext())
    ctx = cpu_ctx()
    _, got = _two_saves_with_data_write(ctx)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert ctx.ledger.summary()["offloaded_count"] >= 2


def test_dedupe_still_shares_unchanged_storage():
    """Sibling views of one unmodified storage still share one host copy (no regression)."""
    ctx = cpu_ctx()
    a = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    with ctx:
        base = a * 1.5
        q, k = base[:, :8], base[:, 8:]
        loss = (q * w).sum() + (k * w).sum()
    loss.backward()
    s = ctx.ledger.summary()
    assert s["kept_by_reason"].get("duplicate_storage", 0) > 0, s
    assert s["d2h_bytes"] == 4 * 16 * 4 + 8 * 4  # base's storage once (shared by q and k), and w once
    assert_reconciles(s)


# -- 3. one reloaded storage shared by two handles --------------------------------------


class _ZeroInBackward(torch.autograd.Function):
    """Saves its input and writes it in place during backward (legal only if nobody else needs it)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x.mul_(0)
        return g * 3


def _sibling_step(ctx) -> torch.Tensor:
    torch.manual_seed(1)
    a = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    with ctx:
        base = a * 1.5
        q, k = base[:, :8], base[:, 8:]
        loss = (q * w).sum() + _ZeroInBackward.apply(k).sum()
    return loss


def test_inplace_in_backward_on_shared_reload_raises_like_autograd():
    """A backward that writes its reloaded input in place is seen by the sibling handle's check."""
    with pytest.raises(RuntimeError, match=INPLACE):
        _sibling_step(contextlib.nullcontext()).backward()
    ctx = cpu_ctx()
    loss = _sibling_step(ctx)
    assert ctx.ledger.summary()["kept_by_reason"].get("duplicate_storage", 0) > 0
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


# -- 4, 5. no reference cycles: graphs and engines are freed by reference counting -------


def test_forward_only_steps_free_everything_without_gc():
    """Forward-only steps with grad on (eval, reference log-probs) return every host copy at once."""
    model = _toy()
    batch = make_batch(TINY, 2, 16, seed=0)
    ctx = get_act_offloading_ctx_manager(model, True, device="cpu")
    with no_gc():
        for _ in range(5):
            with ctx:
                loss = _lm_loss(model, batch)
            assert ctx.ledger.summary()["offloaded_bytes"] > 0
            out = weakref.ref(loss)
            del loss
            assert out() is None
            assert ctx.pool.in_use_bytes == 0, ctx.pool.stats()
            assert ctx._step_ref() is None, "a handle of the freed graph is still alive"


@pytest.mark.parametrize("manager", ["noop", "passthrough", "kept"])
def test_kept_saved_output_does_not_form_a_cycle(manager):
    """A kept saved output (exp saves its result) is freed by refcount: NoOpManager, pass-through, kept."""
    a = torch.randn(256, requires_grad=True)
    if manager == "noop":
        ctx = NoOpManager()
    elif manager == "passthrough":
        with pytest.warns(UserWarning):
            ctx = OffloadActivations(device=None) if not torch.accelerator.is_available() else cpu_ctx()
    else:
        ctx = cpu_ctx(min_offload_size=1 << 30)
    with no_gc():
        with ctx:
            y = a.exp()
        ref = weakref.ref(y)
        del y
        assert ref() is None


def test_partial_grad_and_retain_graph_then_drop_free_everything():
    """autograd.grad over a subset, and retain_graph then drop, leave nothing in the pool."""
    model = _toy()
    batch = make_batch(TINY, 2, 16, seed=0)
    ctx = get_act_offloading_ctx_manager(model, True, device="cpu")
    with no_gc():
        with ctx:
            loss = _lm_loss(model, batch)
        (g,) = torch.autograd.grad(loss, [model.layers[-1].mlp.w2.weight])
        assert g is not None
        del loss
        assert ctx.pool.in_use_bytes == 0
        with ctx:
            loss = _lm_loss(model, batch)
        loss.backward(retain_graph=True)
        assert ctx.pool.in_use_bytes > 0  # the retained graph still owns its copies (Rule 1)
        del loss
        assert ctx.pool.in_use_bytes == 0


def test_engine_built_per_step_is_freed_by_refcount():
    """An engine (and its pool) nobody references is freed without a garbage collection."""
    model = _toy()
    batch = make_batch(TINY, 2, 16, seed=0)
    refs = []
    with no_gc():
        for _ in range(3):
            ctx = get_act_offloading_ctx_manager(model, True, device="cpu")
            with ctx:
                loss = _lm_loss(model, batch)
            loss.backward()
            refs.append((weakref.ref(ctx), weakref.ref(ctx.pool)))
            del ctx, loss
        assert all(r() is None and p() is None for r, p in refs)
    assert not model.output._forward_pre_hooks and not model.output._forward_hooks  # exclusion hooks removed


def test_engine_survives_until_backward_when_only_the_graph_holds_it():
    """Dropping the engine between forward and backward is fine: the graph's handles keep it."""
    model = _toy()
    twin = twin_of(model)
    batch = make_batch(TINY, 2, 16, seed=0)
    with cpu_ctx() as ctx:
        loss = _lm_loss(model, batch)
    ref = weakref.ref(ctx)
    del ctx
    loss.backward()
    _lm_loss(twin, batch).backward()
    assert_same_grads(model, twin)
    del loss
    gc.collect()
    assert ref() is None


# -- 6. bookkeeping bounded in forward-only loops -------------------------------------------


def test_forward_only_loop_bookkeeping_is_bounded():
    """Pack-order lists, dedupe tables and open steps do not grow over forward-only steps."""
    model = _toy()
    batch = make_batch(TINY, 2, 16, seed=0)
    ctx = get_act_offloading_ctx_manager(model, True, device="cpu")
    sizes = []
    for i in range(60):
        with ctx:
            loss = _lm_loss(model, batch)
        del loss
        if i in (9, 59):
            sizes.append((len(ctx._thread().order), len(ctx._dedupe), len(ctx._seen.entries)))
    per_step = ctx.ledger.step_totals[0].offloaded_count
    assert sizes[1][0] <= max(1024, 2 * per_step) + per_step, sizes
    assert sizes[1][1] <= sizes[0][1] + per_step and sizes[1][2] <= sizes[0][2] + 64, sizes
    # Forward-only steps close when their graphs are gone: one ledger step each
    # (the last one is still open).
    assert ctx.ledger.summary()["steps"] == 59
    # ...and a backward afterwards works and is bitwise.
    twin = twin_of(model)
    with ctx:
        loss = _lm_loss(model, batch)
    loss.backward()
    _lm_loss(twin, batch).backward()
    assert_same_grads(model, twin)


# -- 8. one engine shared by threads -------------------------------------------------------


def test_one_engine_shared_by_two_threads_is_bitwise_and_isolated():
    """Two threads share one engine: grads bitwise, and ctx.excluded() in one excludes only its own saves."""
    ctx = cpu_ctx()
    models = [_toy(seed=s) for s in (0, 1)]
    twins = [twin_of(m) for m in models]
    batch = make_batch(TINY, 2, 16, seed=3)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []
    reasons: dict[int, set] = {0: set(), 1: set()}

    def observer(ev):
        reasons[0 if threading.get_ident() == ids[0] else 1].add(ev.record.reason)

    ids = {}

    def run(i):
        try:
            ids[i] = threading.get_ident()
            for _ in range(6):
                barrier.wait()
                region = ctx.excluded() if i == 0 else contextlib.nullcontext()
                with ctx, region:
                    loss = _lm_loss(models[i], batch)
                barrier.wait()
                loss.backward()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    handle = ctx.add_observer(observer)
    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    handle.remove()
    assert not errors, errors
    for m, tw in zip(models, twins):
        for _ in range(6):
            _lm_loss(tw, batch).backward()
        assert_same_grads(m, tw)
    assert "" not in reasons[0] and "excluded_region" in reasons[0]  # thread 0 excluded everything
    assert "" in reasons[1] and "excluded_region" not in reasons[1]  # thread 1 was not affected
    assert not ctx._passes and ctx.pool.in_use_bytes == 0


# -- 9. partial state undone on every exit path ----------------------------------------------


def test_failed_enter_leaves_nothing_behind():
    """Entering under disable_saved_tensors_hooks raises and leaves no engine or module tracking on."""
    ctx = cpu_ctx()
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        with pytest.raises(RuntimeError, match="no hooks here"):
            with ctx:
                pass
    assert active_engine() is None
    # No scope open (the wrapper itself may stay while ctx lives: NOTE [ Wrapper lifetime ]).
    assert offload_modules._global_users == 0 and offload_modules._tls.depth == 0
    assert ctx._thread().enter_depth == 0
    with ctx:  # and it still works afterwards
        y = torch.randn(64, requires_grad=True).exp()
    y.sum().backward()


class _InterruptingHead(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin
        self.fire = False

    def forward(self, x):
        if self.fire:
            self.fire = False
            raise KeyboardInterrupt
        return self.lin(x)


def test_keyboard_interrupt_in_excluded_head_does_not_exclude_later_steps():
    """A KeyboardInterrupt while the excluded head runs leaves later steps offloading as before."""
    model = _toy()
    model.output = _InterruptingHead(model.output)
    batch = make_batch(TINY, 2, 16, seed=0)
    ctx = cpu_ctx()
    ctx.exclude(model.output)
    model.output.fire = True
    with pytest.raises(KeyboardInterrupt):
        with ctx:
            _lm_loss(model, batch)
    with ctx:
        loss = _lm_loss(model, batch)
    loss.backward()
    last = ctx.ledger.step_totals[-1]
    assert last.offloaded_count > 0, last
    assert ctx._thread().excluded_depth == 0 and not ctx._thread().region_stack


# -- 13. recompute during backward (TRL / axolotl wrap the whole step) -----------------------


@pytest.mark.parametrize("reentrant", [True, False])
def test_recompute_in_backward_stays_on_device_and_one_backward_is_one_step(reentrant):
    """Saves of a forward recomputed in backward are kept (in_backward); one backward = one step."""
    model = _toy()
    twin = twin_of(model)
    batch = make_batch(TINY, 2, 16, seed=0)

    def ckpt_loss(m):
        tokens, targets = batch
        h = m.tok_embeddings(tokens)
        for blk in m.layers:
            h = checkpoint(blk, h, m.rope_cos, m.rope_sin, use_reentrant=reentrant)
        logits = m.output(m.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    ctx = cpu_ctx()
    plain = cpu_ctx()
    with plain:  # offloaded forward only: the reference volume of what moves
        ref_loss = ckpt_loss(twin_of(model))
    moved = plain.ledger.summary()["d2h_bytes"]
    del ref_loss
    for _ in range(2):
        model.zero_grad()
        with ctx:  # the whole step inside, as TRL does
            loss = ckpt_loss(model)
            loss.backward()
    assert ctx.ledger.summary()["steps"] == 2
    step = ctx.ledger.step_totals[-1]
    assert step.d2h_bytes == moved, (step.d2h_bytes, moved)
    if reentrant:
        assert step.kept_by_reason.get("in_backward", 0) > 0, step.kept_by_reason
    ckpt_loss(twin).backward()
    twin.zero_grad()
    ckpt_loss(twin).backward()
    assert_same_grads(model, twin)


# -- 14. the loss inside the model ---------------------------------------------------------


class _HFStyle(nn.Module):
    """Computes the loss inside forward after the head, like model(input_ids, labels=...)."""

    def __init__(self, inner: ToyLlama) -> None:
        super().__init__()
        self.inner = inner
        self.lm_head = inner.output

    def forward(self, tokens, labels):
        logits = self.inner(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def test_loss_inside_model_is_not_offloaded_and_next_call_offloads_again():
    """Saved after the head (log-probs of the loss) stays on the device; the next model call offloads."""
    model = _HFStyle(_toy())
    twin = twin_of(model)
    tokens, targets = make_batch(TINY, 2, 16, seed=0)
    ctx = get_act_offloading_ctx_manager(model, True, device="cpu")
    rec = []
    ctx.add_observer(lambda ev: rec.append(ev.record))
    with ctx:  # two model calls in one context (e.g. two micro-batches)
        loss = model(tokens, targets) + model(tokens, targets)
    loss.backward()
    (twin(tokens, targets) + twin(tokens, targets)).backward()
    assert_same_grads(model, twin)
    after = [r for r in rec if r.reason == "after_head"]
    assert after, [r.reason for r in rec]
    vocab_f32 = [r for r in after if r.dtype == "torch.float32" and r.shape and r.shape[-1] == TINY.vocab_size]
    assert vocab_f32, "the float32 [tokens, vocab] log-probs must be kept"
    assert not [r for r in rec if r.decision == "offloaded" and r.shape and r.shape[-1] == TINY.vocab_size]
    # The second call's blocks were offloaded again (the tail ends at the next model call).
    blocks = [r for r in rec if r.decision == "offloaded"]
    half = len(rec) // 2
    assert any(r.seq >= rec[half].seq for r in blocks), "second call offloaded nothing"


# -- trace ranges (issue 9 item 13) ---------------------------------------------------------


def test_profiler_trace_shows_pack_and_copy_ranges():
    """A torch.profiler trace of an offloaded step names the pack, D2H, H2D, unpack and prefetch ranges."""
    model = _toy()
    batch = make_batch(TINY, 2, 16, seed=0)
    ctx = cpu_ctx(prefetch_bytes=1 << 20)  # synchronous copies load nothing ahead by default
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with ctx:
            loss = _lm_loss(model, batch)
        loss.backward()
    names = {e.name for e in prof.events()}
    for want in ("offload::pack", "offload::d2h", "offload::h2d", "offload::unpack", "offload::prefetch"):
        assert want in names, (want, sorted(n for n in names if n.startswith("offload")))


@pytest.mark.parametrize("native", [False, True], ids=["python_hook", "native_hook"])
def test_a_profiled_step_runs_the_hook_an_unprofiled_one_runs(native):
    """Under torch.profiler the engine pushes the same pack hook as without it (the C++ one where it is
    configured: a profiled step costs what a measured one does) and every pack opens an ``offload::pack``
    range, from either hook."""
    from offload import _native
    from offload._torch_private import top_saved_tensors_hooks

    if native:
        try:
            _native.load()
        except _native.NativeUnavailable as e:
            pytest.skip(f"the C++ pack hook cannot be built here: {e}")
    model = _toy()
    batch = make_batch(TINY, 2, 16, seed=0)
    ctx = cpu_ctx(native_hooks=native)
    pushed = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with ctx:
            pushed.append(top_saved_tensors_hooks()[0])
            loss = _lm_loss(model, batch)
        loss.backward()
    with ctx:
        plain = top_saved_tensors_hooks()[0]
    assert ctx._owns_pack_hook(pushed[0]) and ctx._owns_pack_hook(plain)
    for hook in (pushed[0], plain):  # the same kind of hook with and without the profiler
        assert (ctx._native is not None and ctx._native.is_hook_of(hook, ctx)) is native
    packs = sum(e.name == "offload::pack" for e in prof.events())
    assert packs == ctx.ledger.summary()["packed_count"] > 0


@pytest.mark.emulated
def test_inplace_write_while_copy_in_flight_is_detected_on_the_stream_path():
    """Emulated streams: a write landing while the D2H copy is in flight (late data: it really is) is
    caught at unpack; the checker names the race (the write on compute vs the copy's read)."""
    from offload.testing import EmulatedAccelerator

    with EmulatedAccelerator(late=True) as acc:
        ctx = cpu_ctx()
        a = torch.randn(64, requires_grad=True)
        with ctx:
            loss = _masked_fill_step(a)  # exp's result is written while its copy is in flight
        assert ctx.backend == "stream" and ctx.ledger.summary()["offloaded_count"] > 0
        with pytest.raises(RuntimeError, match=INPLACE):
            loss.backward()
    assert {(h.kind, h.ops) for h in acc.hazards} == {("unordered access", ("aten::masked_fill_", "aten::copy_"))}


def test_pageable_overflow_is_accounted():
    """on_host_budget="pageable": the ledger's d2h bytes = pool received + overflow bytes (item 11)."""
    model = _toy()
    batch = make_batch(TINY, 2, 16, seed=0)
    ctx = cpu_ctx(host_budget_bytes=64 << 10, on_host_budget="pageable")
    for _ in range(2):
        with ctx:
            loss = _lm_loss(model, batch)
        loss.backward()
    s, p = ctx.ledger.summary(), ctx.pool.stats()
    assert p["overflow_bytes"] > 0 and p["overflow_count"] > 0, p
    assert s["d2h_bytes"] == p["received_bytes"] + p["overflow_bytes"], (s["d2h_bytes"], p)
    assert p["reserved_bytes"] <= 64 << 10


def test_version_tracker_never_changes_the_tensors_version(monkeypatch):
    """Following a tensor's version counter never bumps it, not even transiently.

    Another thread saving the same tensor (a shared batch) would otherwise read a
    bumped version and later report a spurious in-place modification. Any reset
    of the counter is intercepted and the version seen at that moment recorded.
    """
    from offload import _torch_private

    x = torch.randn(8, requires_grad=True).exp()
    seen = []
    real = torch._C._autograd._unsafe_set_version_counter

    def spy(tensors, versions):
        seen.extend(int(t._version) for t in tensors)
        return real(tensors, versions)

    monkeypatch.setattr(torch._C._autograd, "_unsafe_set_version_counter", spy)
    for _ in range(100):
        tr = _torch_private.version_tracker(x)
        assert tr is not None and tr._version == 0 and tr.untyped_storage().nbytes() == 0
    assert x._version == 0 and all(v == 0 for v in seen), seen
    x.mul_(2)
    assert tr._version == 1  # still follows the counter
