"""Whole training steps on the engine's side-stream path under offload.testing's emulator: every
aten op checked for a happens-before order (zero hazards) and, in late mode, side-stream work really
run late; gradients bitwise equal to a twin trained without offloading, in both modes."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import offload
import offload_testkit
from offload.testing import EmulatedAccelerator, inject_fault
from offload_testkit import (TINY, assert_same_grads, compiled_toy_reference, cpu_ctx, loss_of, make_batch,
                             make_inputs, make_model, run_step, twin_of)

pytestmark = pytest.mark.emulated

MODES = [pytest.param(False, id="check"), pytest.param(True, id="late")]


def _train(acc, model, twin, ctx, batches, loss_fn=loss_of):
    assert ctx.backend == "stream"
    for inputs in batches:
        got = run_step(model, inputs, ctx, loss_fn=loss_fn)
        want = run_step(twin, inputs, None, loss_fn=loss_fn)
        assert torch.equal(got, want)
    acc.synchronize()
    assert_same_grads(model, twin)
    s = ctx.ledger.summary()
    assert s["offloaded_bytes"] > 0, s
    return s


SETTINGS = {
    "default": {},
    "stash1": dict(max_fwd_stash_size=1),
    "inflight1": dict(max_inflight_bytes=1),
    "prefetch_off": dict(prefetch_bytes=0),
    "prefetch_all": dict(prefetch_bytes=1 << 30, max_inflight_bytes=1),
}


@pytest.mark.parametrize("late", MODES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_toy_llama_steps(late, setting):
    """The toy Llama, two steps, under each stash / in-flight / prefetch setting."""
    with EmulatedAccelerator(late=late) as acc:
        model = make_model("toy")
        twin = twin_of(model)
        ctx = cpu_ctx(**SETTINGS[setting])
        _train(acc, model, twin, ctx, [make_inputs("toy", seed=i) for i in range(2)])
    acc.assert_no_hazards()


@pytest.mark.parametrize("late", MODES)
def test_variable_sequence_lengths_reuse_the_pool(late):
    """Steps of different lengths: host buffers are reused across shapes, and nothing races on them."""
    with EmulatedAccelerator(late=late) as acc:
        model = make_model("toy")
        twin = twin_of(model)
        ctx = cpu_ctx(max_fwd_stash_size=2)
        batches = [make_batch(TINY, 2, t, seed=t) for t in (16, 8, 12, 16)]
        _train(acc, model, twin, ctx, batches)
        assert ctx.pool.stats()["in_use_bytes"] == 0
    acc.assert_no_hazards()


def _reentrant_loss(model, inputs):
    x, y = inputs
    h = model.tok_embeddings(x)
    for layer in model.layers:
        h = checkpoint(layer, h, model.rope_cos, model.rope_sin, use_reentrant=True)
    logits = model.output(model.norm(h))
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("late", MODES)
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_activation_checkpointing(late, reentrant):
    """Checkpointed blocks (the checkpoint inputs offloaded; recompute in backward)."""
    with EmulatedAccelerator(late=late) as acc:
        model = make_model("toy")
        model.checkpoint_blocks = not reentrant
        twin = twin_of(model)
        ctx = cpu_ctx(max_fwd_stash_size=1)
        loss_fn = _reentrant_loss if reentrant else loss_of
        _train(acc, model, twin, ctx, [make_inputs("toy", seed=i) for i in range(2)], loss_fn)
    acc.assert_no_hazards()


@pytest.mark.parametrize("late", MODES)
def test_several_forwards_then_one_backward_and_retain_graph(late):
    """Rule 1 on the stream path: two forwards, one backward of their sum twice (retain_graph)."""
    with EmulatedAccelerator(late=late) as acc:
        model = make_model("toy")
        twin = twin_of(model)
        ctx = cpu_ctx(max_fwd_stash_size=1, prefetch_bytes=1 << 20)
        a, b = make_inputs("toy", seed=1), make_inputs("toy", seed=2)
        with ctx:
            loss = loss_of(model, a) + loss_of(model, b)
        ref = loss_of(twin, a) + loss_of(twin, b)
        for _ in range(2):
            loss.backward(retain_graph=True)
            ref.backward(retain_graph=True)
        del loss, ref
        acc.synchronize()
        assert_same_grads(model, twin)
        assert ctx.pool.stats()["in_use_bytes"] == 0
    acc.assert_no_hazards()




@pytest.mark.parametrize("late", MODES)
def test_two_threads_share_one_engine(late):
    """Rule 12: two threads train their own models through one engine; each thread enters the emulator."""
    ctx_box = {}
    errors = []
    with EmulatedAccelerator(late=late) as acc:
        ctx_box["ctx"] = cpu_ctx(max_fwd_stash_size=2)
        pairs = [(make_model("toy", seed=i), None) for i in range(2)]
        pairs = [(m, twin_of(m)) for m, _ in pairs]
        barrier = threading.Barrier(2)

        def work(i):
            try:
                with acc:
                    model, twin = pairs[i]
                    barrier.wait()
                    for step in range(2):
                        inputs = make_inputs("toy", seed=10 * i + step)
                        run_step(model, inputs, ctx_box["ctx"])
                        run_step(twin, inputs)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for model, twin in pairs:
        assert_same_grads(model, twin)
    acc.assert_no_hazards()


@pytest.mark.parametrize("late", MODES)
def test_tiny_hugging_face_llama(late):
    """A Hugging Face Llama (random weights) through get_act_offloading_ctx_manager on the stream path."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    twin = twin_of(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def hf_loss(m, inputs):
        return m(input_ids=inputs, labels=inputs).loss

    with EmulatedAccelerator(late=late) as acc:
        ctx = offload.get_act_offloading_ctx_manager(model, True, device="cpu", min_offload_size=0,
                                                     max_fwd_stash_size=1)
        _train(acc, model, twin, ctx, [ids, ids.flip(1)], hf_loss)
    acc.assert_no_hazards()


@pytest.mark.parametrize("late", MODES)
def test_plan_apply(late):
    """offload.plan(...).apply: the plan's own engine, attached to the blocks, on the stream path."""
    model = make_model("toy")
    twin = twin_of(model)
    inputs = make_inputs("toy")

    def step():
        return loss_of(model, inputs)

    p = offload.plan(model, step, budget_bytes=1 << 40, device="cpu", timed=1)
    model.zero_grad(set_to_none=True)
    decisions = {name: "offload" for name in p.decisions}
    plan = offload.Plan(decisions=decisions, budget_bytes=p.budget_bytes, predicted_peak_bytes=0,
                        predicted_step_seconds=0.0, cost=None, device="cpu", engine_kwargs={"min_offload_size": 0})
    with EmulatedAccelerator(late=late) as acc:
        handle = plan.apply(model)
        try:
            assert handle.engine.backend == "stream"
            for i in range(2):
                batch = make_inputs("toy", seed=i)
                loss_of(model, batch).backward()
                loss_of(twin, batch).backward()
            acc.synchronize()
        finally:
            handle.remove()
        assert handle.engine.ledger.summary()["offloaded_bytes"] > 0
    assert_same_grads(model, twin)
    acc.assert_no_hazards()


def _counted(backend: str) -> tuple[Any, list[int]]:
    """A torch.compile backend that is ``backend`` and counts the runs of the graphs it compiled."""
    runs = [0]
    inner = torch._dynamo.lookup_backend(backend)

    def compile_fn(gm, example_inputs):
        compiled = inner(gm, example_inputs)

        def run(*args):
            runs[0] += 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # (called as the inner one is)
        return run

    return compile_fn, runs


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_on_the_stream_path(backend):
    """torch.compile'd toy Llama on the emulated stream path, checked and with late data: zero hazards,
    bitwise with the compiled reference. Dynamo compiles with the emulator's dispatch mode off and runs
    the compiled code under it (_Mode.ignore_compile_internals): with aot_eager every aten op of the
    compiled forward and backward graphs is checked and runs late; with Inductor its own kernels are
    invisible, the engine's copies, waits and frees and the ops left to aten are checked."""
    torch._dynamo.reset()
    try:
        fn, runs = _counted(backend)
        model, compiled, inputs, want, ref = compiled_toy_reference(backend=fn)
        for late in (False, True):
            before = runs[0]
            with EmulatedAccelerator(late=late) as acc:
                ctx = cpu_ctx(max_fwd_stash_size=1)
                assert ctx.backend == "stream"
                with ctx:
                    loss = loss_of(compiled, inputs)
                loss.backward()
                acc.synchronize()
            acc.assert_no_hazards()
            assert runs[0] > before, "the compiled graph did not run under the emulator (an eager fallback)"
            assert torch.equal(loss, want)
            for n, p in model.named_parameters():
                assert torch.equal(p.grad, ref[n]), n
            model.zero_grad(set_to_none=True)
            s = acc.summary()
            assert s["ops_checked"] > 0 and (s["late_ops_run"] > 0) == late
            assert ctx.ledger.summary()["offloaded_bytes"] > 0
        # And the check is real: compute not waiting for its reloads is reported, also when the
        # reads are Inductor's (the reload's views and copies before them are aten ops).
        with inject_fault("compute_waits_copy"), EmulatedAccelerator() as acc:
            with cpu_ctx(max_fwd_stash_size=1, timing=False):
                loss = loss_of(compiled, inputs)
            loss.backward()
        model.zero_grad(set_to_none=True)
        assert "unordered access" in {h.kind for h in acc.hazards}
    finally:
        torch._dynamo.reset()


class _RoomyAccelerator(EmulatedAccelerator):
    """An emulated device with allocator statistics (NOTE [ Copy schedule ] item 3): a gigabyte in use when
    the forward leaves the engine, none once backward runs, so every reload of the region is issued as early
    as possible: at the pass's first unpack, long before it is read."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.readings = 0

    def memory_allocated(self, device: Any = None) -> int:
        self.readings += 1
        return 0 if torch._C._current_graph_task_id() >= 0 else 1 << 30

    def max_memory_allocated(self, device: Any = None) -> int:
        return 1 << 30


@pytest.mark.parametrize("late", MODES)
@pytest.mark.parametrize("first_blocks", [1, 3])
def test_reloads_issued_as_early_as_memory_allows(late, first_blocks):
    """The toy Llama with only its first blocks offloaded (the later ones excluded, as a plan keeps them) on a
    device whose headroom lets backward load the whole region at its first unpack, a kept tensor's: zero
    hazards, bitwise gradients, and the region's reloads all in flight before backward reaches it."""
    with _RoomyAccelerator(late=late) as acc:
        torch.manual_seed(0)
        model = offload_testkit.ToyLlama(dataclasses.replace(TINY, n_layers=4))
        twin = twin_of(model)
        ctx = cpu_ctx()
        for block in list(model.layers)[first_blocks:]:
            ctx.exclude(block)
        ctx.exclude(offload.find_output_head(model), keep_after=True)  # the head and loss kept, as plans do
        issued_by_kept = []
        kept_unpacked = ctx._kept_unpacked

        def spy(step):
            before = len(ctx._passes) and sum(p.prefetched_bytes for p in list(ctx._passes.values()))
            kept_unpacked(step)
            after = sum(p.prefetched_bytes for p in list(ctx._passes.values()))
            issued_by_kept.append(after - (before or 0))

        ctx._kept_unpacked = spy
        s = _train(acc, model, twin, ctx, [make_inputs("toy", seed=i) for i in range(2)])
    acc.assert_no_hazards()
    assert sum(issued_by_kept) > 0, "no reload was issued by a kept tensor's unpack"
    assert acc.readings > 0
    assert s["h2d_bytes"] > 0
