"""Two threads, each with its own model and engine, training at the same time.

saved_tensors_hooks, the module-scope stack and pack observers are
thread-local; the pool, ledger and step closing are per engine. A barrier
before every step forces the two forwards and the two backwards to overlap.
Any cross-talk shows up as a wrong pack count, a foreign event, or a grad that
differs from the same thread's single-threaded no-offload reference.
"""

from __future__ import annotations

import inspect
import threading

import torch
from torch.autograd.graph import saved_tensors_hooks

from bench.model import ToyLlamaConfig
from offload import add_pack_observer

from ._common import assert_ledger_consistent, engine, grads_of, in_use_after_gc, make_batch, make_model, train_step, twin

STEPS = 8
CONFIGS = {
    "a": (ToyLlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, max_seq_len=128), False),
    "b": (ToyLlamaConfig(vocab_size=96, dim=48, n_layers=3, n_heads=4, max_seq_len=128), True),  # with AC
}


def _batches(cfg, name):
    return [make_batch(cfg, 2, 8 + 4 * (i % 3), seed=1000 * len(name) + i) for i in range(STEPS)]


def _reference(cfg, ac, model, batches):
    """Single-threaded, no offloading: per-step loss, grads and number of saved tensors."""
    ref = twin(model)
    ref.checkpoint_blocks = ac
    out = []
    for batch in batches:
        n = [0]

        def count(t):
            n[0] += 1
            return t

        ref.zero_grad(set_to_none=True)
        tokens, targets = batch
        with saved_tensors_hooks(count, lambda t: t):
            logits = ref(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        out.append((loss.detach(), grads_of(ref), n[0]))
    return out


def test_two_threads_two_engines_concurrently():
    """Each thread's grads equal its own single-threaded reference bitwise; no event crosses threads."""
    setups = {}
    for i, (name, (cfg, ac)) in enumerate(CONFIGS.items()):
        model = make_model(seed=i, cfg=cfg)
        batches = _batches(cfg, name)
        expected = _reference(cfg, ac, model, batches)
        model.checkpoint_blocks = ac
        setups[name] = (model, batches, expected, engine())

    barrier = threading.Barrier(len(setups))
    errors: dict[str, BaseException] = {}
    foreign: dict[str, int] = {name: 0 for name in setups}
    observed: dict[str, int] = {name: 0 for name in setups}

    def worker(name):
        model, batches, expected, ctx = setups[name]

        def on_pack(ev):
            observed[name] += 1
            if ev.engine is not ctx:
                foreign[name] += 1

        handle = None
        try:
            handle = add_pack_observer(on_pack)
            for step, batch in enumerate(batches):
                model.zero_grad(set_to_none=True)
                packed_before = ctx.ledger.summary()["packed_count"]
                barrier.wait(timeout=60)
                loss = train_step(model, batch, ctx)
                want_loss, want_grads, want_packs = expected[step]
                assert torch.equal(loss, want_loss), f"thread {name} step {step}: loss differs"
                got = grads_of(model)
                for pname, g in want_grads.items():
                    assert torch.equal(got[pname], g), f"thread {name} step {step}: grad of {pname} differs"
                packs = ctx.ledger.summary()["packed_count"] - packed_before
                assert packs == want_packs, f"thread {name} step {step}: {packs} packs, expected {want_packs}"
        except BaseException as e:  # reported in the main thread
            errors[name] = e
            barrier.abort()
        finally:
            if handle is not None:
                handle.remove()

    threads = [threading.Thread(target=worker, args=(name,), name=f"offload-{name}") for name in setups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    for name, e in errors.items():
        if not isinstance(e, threading.BrokenBarrierError):
            raise AssertionError(f"thread {name} failed: {e!r}") from e
    assert not errors, errors
    for name, (model, _, expected, ctx) in setups.items():
        s = ctx.ledger.summary()
        assert foreign[name] == 0, f"thread {name} saw {foreign[name]} packs of the other engine"
        assert observed[name] == s["packed_count"] == sum(e[2] for e in expected), (name, observed[name], s)
        assert s["steps"] == STEPS, (name, s["steps"])
        assert s["offloaded_count"] > 0
        assert_ledger_consistent(s)
        assert in_use_after_gc(ctx) == 0


def test_finished_threads_leave_no_state_in_the_engine():
    """A forward and backward on a new thread per step (DataParallel-style): once a thread has ended,
    nothing in the engine holds its per-thread state (the pack order prefetch walks), so the engine's
    memory does not grow with the number of threads (before: one list per thread, for ever)."""
    import gc

    cfg = ToyLlamaConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=32)
    model = make_model(0, cfg)
    ctx = engine(prefetch_bytes=1 << 20)  # keeps a pack order even with synchronous copies
    batch = make_batch(cfg, 2, 8, seed=0)
    orders: list = []
    errors: list = []

    def work() -> None:
        try:
            train_step(model, batch, ctx)
            orders.append(ctx._thread().order)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    for _ in range(20):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert not errors, errors
    assert len(orders) == 20 and ctx.ledger.summary()["offloaded_count"] > 0
    gc.collect()
    holders = [r for o in orders for r in gc.get_referrers(o) if r is not orders and not inspect.isframe(r)]
    assert holders == [], f"{len(holders)} references to finished threads' state"


def test_a_backward_ending_on_another_thread_leaves_an_open_forward_whole():
    """Issue 22 defect 5: thread B's backward ends while thread A is between two saves of one tensor. A's
    forward is still open, so the step must not close under it: A's second save shares the first one's
    host copy (duplicate_storage, one D2H) in the same ledger step, and A's gradients stay bitwise."""
    ctx = engine()
    a_saved, b_done = threading.Event(), threading.Event()
    errors: list = []
    w = torch.randn(32, 32, requires_grad=True)
    grads = {}

    def thread_a() -> None:
        try:
            with ctx:
                xa = w * 2.0
                y = xa.sin()  # saves xa: offloaded
                a_saved.set()
                assert b_done.wait(30)
                y = y + xa.cos()  # saves xa again, after B's backward ended
            y.sum().backward()
            grads["a"] = w.grad.clone()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            a_saved.set()

    def thread_b() -> None:
        try:
            assert a_saved.wait(30)
            v = torch.randn(16, 16, requires_grad=True)
            with ctx:
                z = (v * 3.0).exp()
            z.sum().backward()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
        finally:
            b_done.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    # The same forward alone on one thread: what A's records must look like.
    alone = engine()
    ref = w.detach().clone().requires_grad_()
    with alone:
        xr = ref * 2.0
        yr = xr.sin() + xr.cos()
    yr.sum().backward()

    def facts(c):
        return [(r.decision, r.reason, r.copy_bytes) for r in c.ledger.records if r.shape == (32, 32)]

    assert facts(alone)[1][1] == "duplicate_storage"  # the property under test exists on one thread
    assert facts(ctx) == facts(alone), "A's second save was copied again (the step closed under its forward)"
    xa_recs = [r for r in ctx.ledger.records if r.shape == (32, 32)]
    assert xa_recs[0].step == xa_recs[1].step, "A's forward was split over two ledger steps"
    assert torch.equal(grads["a"], ref.grad)
    assert ctx.ledger.summary()["offloaded_count"] > 0 and not ctx._close_pending
