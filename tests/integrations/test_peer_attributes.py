"""The peers' engine attributes (TRL's tests and user code read them) and TRL's module helpers.

TRL's own test suite (tests/test_activation_offloading.py) reads ``tensor_id``,
``tracker``, ``storage_to_tensor_id``, ``param_storages`` and calls
``update_model_params``; the tests here run its scenarios on ``device="cpu"``
(the engine really offloads there) with bitwise gradients, and once more on
CUDA with TRL's exact calls (``gpu``). See NOTE [ Peer attributes are views ].
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import offload
from offload.compat import torchtune as tt
from offload.compat import trl
from offload.compat._peer_attributes import TrackedSave
from offload_testkit import MLP, assert_same_grads

ENGINES = {"offload": offload.OffloadActivations, "compat.torchtune": tt.OffloadActivations,
           "compat.trl": trl.OffloadActivations}


@pytest.fixture(params=sorted(ENGINES))
def engine_cls(request):
    return ENGINES[request.param]


class ModelWithViews(nn.Module):
    """TRL's deduplication model: a linear whose output is read through two views."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(100, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out.view(-1).sum() + out.transpose(0, 1).sum()


class SaveTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        ctx.save_for_backward(t)
        return t.sum()

    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors
        return torch.ones_like(t) * g


def _counts(ctx) -> tuple[int, int]:
    """TRL's way of counting: (offloaded, kept) from ``tracker``'s 5-tuples."""
    values = list(ctx.tracker.values())
    return (sum(1 for _, modified, _, _, _ in values if modified),
            sum(1 for _, modified, _, _, _ in values if not modified))


def test_trl_deduplication_scenario(engine_cls):
    """TRL's test_tensor_deduplication: the input is offloaded, the weight kept; fewer storages than ids."""
    torch.manual_seed(0)
    model = ModelWithViews()
    twin = copy.deepcopy(model)
    ctx = engine_cls(min_offload_size=1, device="cpu")
    ctx.update_model_params(model)
    x = torch.randn(10, 100, requires_grad=True)
    with ctx:
        loss = model(x)
    assert ctx.tensor_id == 2  # addmm saved the input and weight.t()
    assert ctx.tracker == {
        1: TrackedSave(None, True, None, None, (10, 100)),
        2: TrackedSave(None, False, None, None, (100, 100)),
    }
    assert _counts(ctx) == (1, 1)
    assert ctx.storage_to_tensor_id == {(x.untyped_storage().data_ptr(), torch.float32): 1}
    loss.backward()
    assert ctx.tracker == {} and ctx.storage_to_tensor_id == {}
    x2 = x.detach().clone().requires_grad_()
    twin(x2).backward()
    assert_same_grads(model, twin)
    assert torch.equal(x.grad, x2.grad)


def test_storage_saved_twice_is_one_offloaded_storage(engine_cls):
    """A storage saved three times is offloaded once: the other two ids are kept (TRL's ``modified=False``)."""
    ctx = engine_cls(min_offload_size=1, device="cpu")
    x = torch.randn(16, 16, requires_grad=True)
    with ctx:
        y = x.exp()  # saves y
        loss = (y * y).sum()  # saves y twice more
    assert ctx.tensor_id == 3
    assert _counts(ctx) == (1, 2)
    assert list(ctx.storage_to_tensor_id.values()) == [1]
    loss.backward()
    x2 = x.detach().clone().requires_grad_()
    y2 = x2.exp()
    (y2 * y2).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_distinct_tensors_are_never_deduplicated():
    """TRL's test_reused_storage_key_after_stash_reap_is_not_deduplicated, with max_fwd_stash_size=1."""
    first, filler, reused = (torch.randn(4, 4, requires_grad=True) for _ in range(3))
    ctx = offload.OffloadActivations(use_pin_memory=False, use_streams=True, min_offload_size=1,
                                     max_fwd_stash_size=1, device="cpu")
    with ctx:
        loss = SaveTensor.apply(first) + SaveTensor.apply(filler) + SaveTensor.apply(reused)
    assert _counts(ctx) == (3, 0)
    assert len(ctx.storage_to_tensor_id) == 3
    loss.backward()
    for t in (first, filler, reused):
        assert torch.equal(t.grad, torch.ones(4, 4))


class SaveBufferView(torch.autograd.Function):
    """Saves a fresh tensor over one shared bytearray: every save has the same address, and dies at once."""

    @staticmethod
    def forward(ctx, t, memory, value):
        memory[:] = torch.full((64,), value).numpy().tobytes()  # a write no version counter sees
        ctx.save_for_backward(torch.frombuffer(memory, dtype=torch.float32))
        return t.sum()

    @staticmethod
    def backward(ctx, g):
        (saved,) = ctx.saved_tensors
        return saved * g, None, None


@pytest.mark.parametrize("same_bytes", [False, True])
def test_a_reused_address_is_not_a_duplicate(same_bytes):
    """The bug class behind TRL's reused-storage-key test: a dead saver's address is no live view.

    Each save is a new tensor at the same address (the allocator reusing a freed
    source's block, made deterministic), whose first saver is already dead:
    each must get its own host copy, not the first one's. With the same bytes
    each time, the CPU byte comparison cannot tell: only the liveness rule does.
    """
    memory = bytearray(64 * 4)
    xs = [torch.zeros(64, requires_grad=True) for _ in range(4)]
    ctx = offload.OffloadActivations(min_offload_size=1, device="cpu", max_fwd_stash_size=1)
    with ctx:
        loss = sum(SaveBufferView.apply(x, memory, 7.0 if same_bytes else float(i)) for i, x in enumerate(xs))
    assert _counts(ctx) == (4, 0)
    assert len({r.storage_key for r in ctx.ledger.records}) == 1  # one address throughout
    loss.backward()
    for i, x in enumerate(xs):
        assert torch.equal(x.grad, torch.full((64,), 7.0 if same_bytes else float(i)))


def test_tracker_does_not_grow_across_steps_with_an_unused_branch():
    """TRL's test_stale_tracker_state_is_cleared_between_forwards: a branch never backpropagated."""

    class WithUnusedBranch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.used(x).sum(), self.unused(x).sum()

    model = WithUnusedBranch()
    ctx = offload.OffloadActivations(use_pin_memory=False, use_streams=False, min_offload_size=1, device="cpu")
    ctx.update_model_params(model)
    inp = torch.randn(4, 8)
    counts, ids = [], []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with ctx:
            loss, _ = model(inp)
            counts.append(len(ctx.tracker))
        loss.backward()
        counts.append(len(ctx.tracker))
        ids.append(ctx.tensor_id)
    assert counts == [2, 0] * 3  # each linear saves its input; all closed by the backward
    assert ids == [2, 4, 6]  # the counter never resets (the peers' tensor_id)


def test_tracker_is_a_snapshot_clearing_it_changes_nothing():
    """User code that ``tracker.clear()``s after an OOM (as torchtune's needs) is harmless here."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    ctx = offload.OffloadActivations(min_offload_size=0, device="cpu")
    x = torch.randn(4, 32)
    with ctx:
        loss = model(x).square().sum()
    ctx.tracker.clear()
    ctx.storage_to_tensor_id.clear()
    assert len(ctx.tracker) > 0 and ctx.storage_to_tensor_id
    loss.backward()
    twin(x).square().sum().backward()
    assert_same_grads(model, twin)
    assert ctx.ledger.step_totals[-1].offloaded_count > 0


def test_param_storages_match_trls_and_update_model_params_validates(engine_cls):
    """TRL's test_parameter_filtering: param_storages == the parameters' storage pointers."""
    model = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20), nn.Linear(20, 10))
    ctx = engine_cls(device="cpu")
    assert ctx.param_storages == set()
    ctx.update_model_params(model)
    assert ctx.param_storages == {p.data.untyped_storage().data_ptr() for p in model.parameters()}
    assert offload.OffloadActivations(device="cpu", model=model).param_storages == ctx.param_storages
    with pytest.raises(TypeError, match=r"update_model_params: model must be an nn.Module, got a list\. Pass the model"):
        ctx.update_model_params([model])


@pytest.mark.parametrize("update", [False, True])
def test_update_model_params_takes_effect_inside_an_entered_engine(update):
    """A parameter's storage saved through a plain alias (no module running) stays put once the model is known."""
    model = nn.Linear(16, 16)
    ctx = offload.OffloadActivations(min_offload_size=0, device="cpu")
    x = torch.randn(16, 16, requires_grad=True)
    with ctx:
        if update:
            ctx.update_model_params(model)
        loss = (x * model.weight.detach()).sum()  # saves the weight's storage, as a non-Parameter leaf
    rec = [r for r in ctx.ledger.records if r.storage_key == model.weight.untyped_storage().data_ptr()]
    assert [(r.decision, r.reason) for r in rec] == ([("kept", "parameter")] if update else [("offloaded", "")])
    loss.backward()
    assert torch.equal(x.grad, model.weight.detach())


def test_min_tensor_size_bytes_is_the_peers_name_and_read_only(engine_cls):
    ctx = engine_cls(min_offload_size=4096, device="cpu")
    assert ctx.min_tensor_size_bytes == 4096
    with pytest.raises(AttributeError):
        ctx.min_tensor_size_bytes = 0


def test_torchtune_test_may_replace_fwd_stash():
    """torchtune's test_offloading_works_with_view_outputs assigns ``ctx.fwd_stash = {}`` after forward."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 32)
    ctx = tt.OffloadActivations(use_streams=True, device="cpu", min_offload_size=0)
    with ctx:
        loss = model(x).sum()
    ctx.fwd_stash = {}
    loss.backward()
    twin(x).sum().backward()
    assert_same_grads(model, twin)


def test_trl_unique_tensor_key():
    """compat.trl._get_unique_tensor_key: TRL's (storage pointer + offset, dtype) key."""
    base = torch.arange(12.0)
    key = trl._get_unique_tensor_key
    assert key(base) == (base.untyped_storage().data_ptr(), torch.float32)
    assert key(base.view(3, 4)) == key(base)  # a view at the same offset: the same key
    assert key(base[4:])[0] == base.untyped_storage().data_ptr() + 4  # TRL adds the element offset
    assert key(base.to(torch.float64)) != key(base)


# -- TRL's selective activation checkpointing --------------------------------------------------------


try:
    import transformers
except ImportError:  # the CUDA test below runs without it
    transformers = None


class _SdpaCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """How many fused-attention operators (forward and backward) run at the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _llama() -> nn.Module:
    if transformers is None:
        pytest.skip("needs transformers (the test extra)")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    return model


def _step(model, ctx=None) -> tuple[torch.Tensor, int]:
    torch.manual_seed(1)
    inp = torch.randint(0, 64, (2, 16))
    counter = _SdpaCounter()
    with counter:
        with ctx if ctx is not None else torch.enable_grad():
            loss = model(input_ids=inp, labels=inp).loss
        loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grads, counter.count


@functools.lru_cache(maxsize=1)
def _full_checkpointing() -> tuple[torch.Tensor, int]:
    model = _llama()
    name, kwargs_name = trl._checkpointing_entry(model)
    getattr(model, name)(**{kwargs_name: {"use_reentrant": False}})
    return _step(model)


@pytest.mark.parametrize("offloaded", [False, True])
def test_selective_checkpointing_saves_attention_with_full_checkpointings_grads(offloaded):
    """TRL's test: SAC gradients equal full checkpointing's (bitwise here), attention recomputed less often."""
    grads_full, sdpa_full = _full_checkpointing()
    model = _llama()
    trl.enable_selective_activation_checkpointing(model)
    getattr(model, trl._checkpointing_entry(model)[0])()
    ctx = offload.OffloadActivations(device="cpu", min_offload_size=0) if offloaded else None
    grads_sac, sdpa_sac = _step(model, ctx)
    assert torch.equal(grads_sac, grads_full)
    assert sdpa_sac < sdpa_full
    if offloaded:
        assert ctx.ledger.step_totals[-1].offloaded_count > 0


def test_selective_checkpointing_forces_non_reentrant_is_idempotent_and_warns_when_already_on():
    model = _llama()
    name, kwargs_name = trl._checkpointing_entry(model)
    trl.enable_selective_activation_checkpointing(model)
    wrapped = getattr(model, name)
    trl.enable_selective_activation_checkpointing(model)  # a second call: nothing changes
    assert getattr(model, name) is wrapped
    wrapped(**{kwargs_name: {"use_reentrant": True}})  # overridden: SAC needs non-reentrant checkpointing
    _, sdpa = _step(model)
    assert sdpa == _full_checkpointing()[1] - 2  # one saved attention forward per layer (2 layers)

    on = _llama()
    getattr(on, name)()
    with pytest.warns(UserWarning, match=r"already on for LlamaForCausalLM.*again"):
        trl.enable_selective_activation_checkpointing(on)


def test_selective_checkpointing_refuses_a_model_without_the_switch():
    with pytest.raises(TypeError, match=r"Sequential has no activation_checkpointing_enable.*context_fn="):
        trl.enable_selective_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)))


# -- on CUDA, TRL's exact calls (no device=) -------------------------------------------------------


@pytest.mark.gpu
def test_gpu_trl_scenarios_with_trls_calls():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = ModelWithViews().cuda()
    ctx = trl.OffloadActivations(min_offload_size=1)
    ctx.update_model_params(model)
    x = torch.randn(10, 100, device="cuda", requires_grad=True)
    with ctx:
        loss = model(x)
    assert ctx.tensor_id > 0
    assert _counts(ctx)[0] > 0 and _counts(ctx)[1] > 0
    assert len(ctx.storage_to_tensor_id) < ctx.tensor_id
    loss.backward()
    assert ctx.tracker == {}
    assert ctx.param_storages == {p.data.untyped_storage().data_ptr() for p in model.parameters()}
