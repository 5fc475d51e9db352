"""Rule 8: excluded regions, NoOpManager and get_act_offloading_ctx_manager's head detection."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload import (
    NoOpManager,
    OffloadActivations,
    active_engine,
    add_pack_observer,
    find_output_head,
    get_act_offloading_ctx_manager,
)
from offload_testkit import (
    MLP,
    Recorder,
    assert_really_offloaded,
    assert_same_grads,
    cpu_ctx,
    loss_of,
    make_inputs,
    make_model,
    run_step,
    twin_of,
)

# --------------------------------------------------------------------------- NoOpManager


def test_noop_manager_keeps_tensors_and_is_invisible_to_accounting():
    """Rule 8: inside NoOpManager saves bypass the engine (identity, not recorded); outside they offload."""
    x = torch.randn(32, 32, requires_grad=True)
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        a = x.sin()  # the engine packs x
        with NoOpManager():
            b = a.exp()  # saves its own output, untouched
            c = a.cos()  # saves a, untouched
        loss = (b * 2).sum() + c.sum()
    assert len(rec.records_for(x)) == 1
    assert rec.records_for(b) == [] and rec.records_for(a) == [], "NoOpManager saves reached the engine"
    assert c.grad_fn._saved_self.data_ptr() == a.data_ptr(), "NoOpManager must save the very same memory (identity hooks)"
    loss.backward()
    x2 = x.detach().clone().requires_grad_()
    a2 = x2.sin()
    ((a2.exp() * 2).sum() + a2.cos().sum()).backward()
    assert torch.equal(x.grad, x2.grad)


def test_noop_manager_alone_is_identity():
    """NoOpManager without an engine is a torchtune-compatible identity saved_tensors_hooks."""
    x = torch.randn(8, 8, requires_grad=True)
    with NoOpManager():
        y = x.sin()
    assert y.grad_fn._saved_self.data_ptr() == x.data_ptr()
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().cos())


# --------------------------------------------------------------------------- exclusion


def test_exclude_module_records_excluded_region_and_remove_restores():
    """ctx.exclude(module): saves inside it stay put with reason "excluded_region"; handle.remove() undoes it."""
    model = make_model("mlp")
    twin = twin_of(model)
    inputs = make_inputs("mlp")
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    handle = ctx.exclude(model.fc2)
    run_step(model, inputs, ctx)
    run_step(twin, inputs)
    assert_same_grads(model, twin)
    fc2 = [r for r in rec.records if r.module.endswith("fc2")]
    assert fc2 and all(r.reason in ("excluded_region", "parameter") for r in fc2), fc2
    assert any(r.reason == "excluded_region" for r in fc2)
    assert not [r for r in rec.records if r.reason == "excluded_region" and not r.module.endswith("fc2")]
    assert any(r.decision == "offloaded" for r in rec.records), "the rest of the model still offloads"

    handle.remove()
    rec.events.clear()
    run_step(model, inputs, ctx)
    fc2 = [r for r in rec.records if r.module.endswith("fc2")]
    assert fc2 and not [r for r in fc2 if r.reason == "excluded_region"], "remove() did not lift the exclusion"
    assert any(r.decision == "offloaded" for r in fc2)


def test_excluded_region_context_manager():
    """ctx.excluded(): saves inside the block are kept as "excluded_region", saves after it offload again."""
    x = torch.randn(32, 32, requires_grad=True)
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        a = x.sin()
        with ctx.excluded():
            b = a.sin()
        c = b.sin()
        loss = c.sum()
    assert rec.records_for(x)[0].decision == "offloaded"
    assert (rec.records_for(a)[0].decision, rec.records_for(a)[0].reason) == ("kept", "excluded_region")
    assert rec.records_for(b)[0].decision == "offloaded"
    loss.backward()
    x2 = x.detach().clone().requires_grad_()
    x2.sin().sin().sin().sum().backward()
    assert torch.equal(x.grad, x2.grad)


# --------------------------------------------------------------------------- head detection


class _LMHeadModel(nn.Module):
    """HF-causal-LM-like: body then ``lm_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 8)

    def forward(self, x):
        return self.lm_head(F.gelu(self.body(x)))


class _HFStyle(nn.Module):
    """Head reachable only through ``get_output_embeddings()`` (neither ``output`` nor ``lm_head``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.proj_out = nn.Linear(32, 8)

    def get_output_embeddings(self):
        return self.proj_out

    def forward(self, x):
        return self.proj_out(F.gelu(self.body(x)))


class _TiedLinear:
    """torchtune's TiedLinear: a plain object (not a Module) whose ``.linear`` module does the matmul."""

    class _Linear(nn.Module):
        def forward(self, x, weight):
            return F.linear(x, weight)

    def __init__(self, tied: nn.Module) -> None:
        self.tied_module = tied
        self.linear = self._Linear()

    def __call__(self, x):
        return self.linear(x, self.tied_module.weight)


class _TTTied(nn.Module):
    """torchtune-style tied model: ``self.output = TiedLinear(self.tok_embeddings)``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(8, 32)
        self.body = nn.Linear(32, 32)
        self.output = _TiedLinear(self.tok_embeddings)

    def forward(self, x):
        return self.output(F.gelu(self.body(x)))


class _TiedUnnamed(nn.Module):
    """Tied head under an unconventional name: found because its weight is an Embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 32)
        self.body = nn.Linear(32, 32)
        self.proj = nn.Linear(32, 8, bias=False)
        self.proj.weight = self.emb.weight

    def forward(self, x):
        return self.proj(F.gelu(self.body(x)))


class _Headless(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


def _head_case(name):
    if name == "output":
        m = make_model("toy")
        return m, m.output, make_inputs("toy")
    if name == "output_tied":
        m = make_model("toy_tied")
        return m, m.output, make_inputs("toy")
    x, y = make_inputs("mlp")
    if name == "lm_head":
        m = _LMHeadModel()
        return m, m.lm_head, (x, y)
    if name == "get_output_embeddings":
        m = _HFStyle()
        return m, m.proj_out, (x, y)
    if name == "tied_unnamed":
        m = _TiedUnnamed()
        return m, m.proj, (x, y)
    if name == "tiedlinear":
        m = _TTTied()
        return m, m.output.linear, (x, y)
    raise ValueError(name)


HEADS = ["output", "output_tied", "lm_head", "get_output_embeddings", "tiedlinear", "tied_unnamed"]


@pytest.mark.parametrize("case", HEADS)
def test_find_output_head(case):
    """find_output_head finds model.output, a tied head, lm_head, get_output_embeddings() and TiedLinear.linear."""
    model, head, _ = _head_case(case)
    assert find_output_head(model) is head


@pytest.mark.parametrize("case", HEADS)
def test_ctx_manager_excludes_the_head(case):
    """get_act_offloading_ctx_manager keeps the head's saves on device ("excluded_region"), bitwise grads."""
    model, head, inputs = _head_case(case)
    twin = twin_of(model)
    ctx = get_act_offloading_ctx_manager(model, True, device="cpu", min_offload_size=0)
    rec = Recorder()
    with ctx:
        eng = active_engine()
        assert isinstance(eng, OffloadActivations)
        h = eng.add_observer(rec)
        loss = loss_of(model, inputs)
    h.remove()
    loss.backward()
    run_step(twin, inputs)
    assert_same_grads(model, twin)
    excluded = rec.by_reason("excluded_region")
    assert excluded, [(r.module, r.reason) for r in rec.records]
    head_name = {m: n for n, m in model.named_modules()}.get(head)
    if head_name is not None:  # TiedLinear.linear is not a registered submodule
        wrong = [r.module for r in excluded if not r.module.endswith(head_name)]
        assert not wrong, f"saves outside {head_name} were excluded: {wrong}"
    assert any(r.decision == "offloaded" for r in rec.records), "the body must still offload"
    assert max(r.nbytes for r in excluded) >= 2048, "the head's input activation must be among the excluded"


def test_ctx_manager_warns_with_fix_when_no_head():
    """No recognisable head: a warning that says what happened and how to fix it; offloading still works."""
    model = _Headless()
    with pytest.warns(UserWarning) as got:
        ctx = get_act_offloading_ctx_manager(model, True, device="cpu", min_offload_size=0)
    msgs = [str(w.message) for w in got]
    assert len(msgs) == 1, msgs
    msg = msgs[0]
    assert "head" in msg.lower(), msg
    assert "exclude" in msg or "output" in msg or "lm_head" in msg, f"warning gives no fix: {msg}"
    x, y = make_inputs("mlp")
    with ctx:
        eng = active_engine()
        loss = loss_of(model, (x, y))
    loss.backward()
    assert_really_offloaded(eng)


def test_ctx_manager_forwards_kwargs():
    """get_act_offloading_ctx_manager passes its kwargs to OffloadActivations (min_offload_size, device...)."""
    model = _LMHeadModel()
    ctx = get_act_offloading_ctx_manager(
        model, True, device="cpu", min_offload_size=1 << 30, use_streams=False, use_pin_memory=False
    )
    with ctx:
        eng = active_engine()
        loss = loss_of(model, make_inputs("mlp"))
    loss.backward()
    s = eng.ledger.summary()
    assert eng.device == torch.device("cpu")
    assert s["offloaded_count"] == 0 and s["packed_count"] > 0
    assert set(s["kept_by_reason"]) <= {"too_small", "parameter", "excluded_region", "after_head"}, s["kept_by_reason"]
    assert s["kept_by_reason"].get("too_small", 0) > 0
    with pytest.raises(TypeError):
        get_act_offloading_ctx_manager(model, True, device="cpu", not_a_setting=1)


def test_ctx_manager_disabled_is_a_null_context():
    """enable_activation_offloading=False gives a null context: no engine, no hooks, nothing observed."""
    model = make_model("mlp")
    ctx = get_act_offloading_ctx_manager(model, False)
    assert not isinstance(ctx, OffloadActivations)
    seen = []
    handle = add_pack_observer(seen.append)
    try:
        with ctx:
            assert active_engine() is None
            loss = loss_of(model, make_inputs("mlp"))
            assert loss.grad_fn is not None
        loss.backward()
    finally:
        handle.remove()
    assert seen == []
    assert isinstance(ctx, contextlib.AbstractContextManager) or hasattr(ctx, "__enter__")


def test_ctx_manager_reentered_across_steps_keeps_head_excluded():
    """The manager returned once is re-entered every step and keeps excluding the head each time."""
    model = _LMHeadModel()
    twin = twin_of(model)
    ctx = get_act_offloading_ctx_manager(model, True, device="cpu", min_offload_size=0)
    for i in range(3):
        inputs = make_inputs("mlp", seed=i)
        rec = Recorder()
        with ctx:
            eng = active_engine()
            h = eng.add_observer(rec)
            loss = loss_of(model, inputs)
        h.remove()
        loss.backward()
        run_step(twin, inputs)
        assert rec.by_reason("excluded_region"), f"step {i}"
    assert_same_grads(model, twin)


def test_exclude_on_mlp_model_arg_unaffected_by_other_instances():
    """Excluding a module of one model does not exclude the same-class module of another model."""
    a, b = MLP(), MLP()
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    ctx.exclude(a.fc2)
    x = torch.randn(4, 32)
    with ctx:
        out = b(x).sum()
    assert not rec.by_reason("excluded_region")
    out.backward()


def test_noop_manager_keeps_inplace_check():
    """NoOpManager keeps autograd's in-place check (its docstring promises Rule 6), with or without an engine."""
    for outer in (contextlib.nullcontext(), cpu_ctx()):
        x = torch.randn(16, 16, requires_grad=True)
        with outer:
            with NoOpManager():
                h = x * 2
                z = h.sin()
        h.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()


class _TorchtuneStyleDecoder(nn.Module):
    """torchtune's TransformerDecoder shape: ``.output`` head, ``skip_output_layer`` (set by its
    LinearCrossEntropyLoss, which then projects through the head itself, in the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, 16)
        self.layer = nn.Linear(16, 16)
        self.output = nn.Linear(16, 32)
        self.skip_output_layer = False
        self.bypass_head = False  # stands in for a stale compiled graph that skips the head's hooks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layer(self.tok(ids)))
        if self.skip_output_layer:
            return h
        if self.bypass_head:
            return F.linear(h, self.output.weight, self.output.bias)
        return self.output(h)


def _unused_region_warnings(step, model, twin, ctx) -> list[str]:
    """Run ``step`` under ``ctx`` and on the twin without it; grads bitwise; the 'nothing was excluded'
    warnings the engine's step raised."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        step(model, ctx)
    step(twin, contextlib.nullcontext())
    assert_same_grads(model, twin)
    return [str(w.message) for w in got if "nothing was excluded" in str(w.message)]


@pytest.mark.parametrize("case", ["skip_output_layer", "head_bypassed"])
def test_unused_head_warning_only_when_the_head_should_have_run(case):
    """torchtune's LinearCrossEntropyLoss sets model.skip_output_layer after the context exists and runs
    the head in the loss, outside it: no warning then. A head that should have run but did not
    (a stale compiled graph, here a bypass) still gets the warning."""
    torch.manual_seed(0)
    model = _TorchtuneStyleDecoder()
    twin = twin_of(model)
    ctx = get_act_offloading_ctx_manager(model, True, device="cpu", min_offload_size=0)
    setattr(model, case.replace("head_bypassed", "bypass_head"), True)
    setattr(twin, case.replace("head_bypassed", "bypass_head"), True)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))

    def step(m, c):
        with c:
            out = m(ids)
        logits = m.output(out) if case == "skip_output_layer" else out  # the loss's own projection
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()

    unused = _unused_region_warnings(step, model, twin, ctx)
    assert len(unused) == (0 if case == "skip_output_layer" else 1), unused


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, 16)
        self.layer = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(self.tok(ids)))


class _Body(nn.Module):
    """An HF body (``OPTModel``) whose own forward the model skips: it calls ``body.decoder`` directly."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = _Decoder()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(ids)


class _OPTStyleLM(nn.Module):
    """Shaped like OPTForCausalLM: ``base_model`` is ``.model``, and forward calls ``self.model.decoder``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Body()
        self.lm_head = nn.Linear(16, 32, bias=False)
        self.fused_head = False  # stands in for TRL's fused head: no head module runs
        self.bypass_all = False  # stands in for a stale compiled graph: neither hook runs

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.bypass_all:
            h = torch.tanh(F.linear(self.model.decoder.tok(ids), self.model.decoder.layer.weight,
                                    self.model.decoder.layer.bias))
            return F.linear(h, self.lm_head.weight)
        if self.fused_head:
            return F.linear(self.model(ids), self.lm_head.weight)
        return self.lm_head(self.model.decoder(ids))


@pytest.mark.parametrize("case,warns", [("body_skipped", 0), ("fused_head", 0), ("bypass_all", 1)])
def test_tail_kept_by_either_region_is_no_reason_to_warn(case, warns):
    """The head region and the after-body region keep the same tail: either one running is enough (OPT
    runs only the head, TRL's fused head only the body), and the tail is kept then; only neither running
    (a stale compiled graph) warns "nothing was excluded"."""
    torch.manual_seed(0)
    model = _OPTStyleLM()
    twin = twin_of(model)
    for m in (model, twin):
        m.fused_head, m.bypass_all = case == "fused_head", case == "bypass_all"
    ctx = get_act_offloading_ctx_manager(model, True, device="cpu", min_offload_size=0)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))

    def step(m, c):
        with c:
            out = m(ids)
            loss = F.cross_entropy(out.flatten(0, 1), ids.flatten())
        loss.backward()

    unused = _unused_region_warnings(step, model, twin, ctx)
    assert len(unused) == warns, unused
    kept = ctx.ledger.summary()["kept_by_reason"]
    if not warns:
        assert kept.get("after_head", 0) + kept.get("excluded_region", 0) > 0, kept


@pytest.mark.parametrize("keep_after", [False, True])
def test_exclude_per_step_leaves_nothing_behind(keep_after):
    """``with ctx.exclude(head):`` used every step registers nothing that outlives the block: the
    engine's finalizers, its region list and the head's hooks stay as they were after the first step
    (before, each step left a finalizer on the engine: ~460 B a step, for ever)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = MLP()
    ctx = cpu_ctx(model=model)
    head = list(model.modules())[-1]
    inputs = make_inputs("mlp")

    def held() -> tuple[int, int, int]:
        gc.collect()
        fins = sum(1 for o in gc.get_objects()
                   if isinstance(o, weakref.finalize) and o.alive and o.peek()[0] is ctx)
        return fins, len(ctx._regions), len(head._forward_hooks) + len(head._forward_pre_hooks)

    def step() -> None:
        with ctx.exclude(head, keep_after=keep_after):
            run_step(model, inputs, ctx)

    step()
    first = held()
    for _ in range(5):
        step()
    assert held() == first
    assert first[2] == 0  # the block removed its hooks
    assert ctx.ledger.summary()["kept_by_reason"].get("excluded_region", 0) > 0  # the exclusion ran
