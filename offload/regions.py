"""Regions that stay on the device: NoOpManager, module exclusion, the output head.

The output head is excluded by default because its activations are consumed
first in backward (so there is no compute to hide the reload behind) and,
for large vocabularies, are the biggest tensors of the step.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._warn import user_stacklevel
from .engine import _Kept

if TYPE_CHECKING:
    from .engine import OffloadActivations

log = logging.getLogger(__name__)

__all__ = [
    "NoOpManager",
    "RegionHandle",
    "exclude_module",
    "keep_after_module",
    "exclude_output_head",
    "find_backbone",
    "warn_unused_regions",
    "find_output_head",
    "get_act_offloading_ctx_manager",
]


class NoOpManager(torch.autograd.graph.saved_tensors_hooks):
    """Leave every tensor saved inside the block where it is (torchtune-compatible).

    It shadows any enclosing OffloadActivations (only the innermost hooks run),
    so what it keeps is invisible to that engine's ledger; prefer
    ``ctx.excluded()`` or ``ctx.exclude(module)``, which keep the same tensors
    and still record them. Unlike a bare identity hook, it keeps autograd's
    in-place check (Rule 6).
    """

    def __init__(self) -> None:
        super().__init__(_Kept, _Kept.unpack)


class RegionHandle:
    """Removable handle of an excluded module (``remove()`` undoes it; idempotent)."""

    def __init__(self, handles: list[Any], name: str = "") -> None:
        self._handles = handles
        self.name = name
        """Class name of the excluded module (for messages)."""
        self.fired = 0
        """How many times the excluded module's forward has started."""
        self.warned = False
        self.optional: bool | Callable[[], bool] = False
        """True (or a callable returning True) when not running is expected: ``warn_unused_regions``
        then says nothing (another region covers it, or the model skips it by design)."""

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "RegionHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def exclude_module(engine: "OffloadActivations", module: nn.Module, *, keep_after: bool = False,
                   root: nn.Module | None = None) -> RegionHandle:
    """Keep tensors saved inside ``module``'s forward on the device, recorded (Rule 8).

    ``keep_after=True`` (the output head) also keeps what is saved after the
    module's forward until the next call of ``root`` (default: the engine's
    ``model``) or the next outermost entry of the engine: the loss computed
    inside or after the model is what backward needs first.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"OffloadActivations.exclude: module must be an nn.Module, got {type(module).__name__}. "
            "To exclude a code region rather than a module, use `with ctx.excluded():`."
        )

    # Under a whole-model torch.compile, the engine's hooks only see the saved
    # tensors after the compiled region ran, so a counter bumped while tracing
    # would exclude nothing. Disabling dynamo on these hooks makes the
    # compiler break the graph around the excluded module: its saved tensors
    # are then packed while the region is still marked (two graph breaks,
    # around the output head by default, in exchange for correct accounting).
    # The hooks hold the engine weakly and are removed when it dies: a context
    # rebuilt every step must not pin old engines (and their host pools).
    # The region counts only on a thread where the engine is entered, and the
    # post hook undoes only what its own pre hook did; the engine restores the
    # thread's region state at its outermost exit, so a KeyboardInterrupt
    # between the two hooks (always_call hooks do not run on it) cannot leave
    # every later step excluded.
    eng_ref = weakref.ref(engine)

    @torch._dynamo.disable
    def pre(mod: nn.Module, args: Any) -> None:
        eng = eng_ref()
        if eng is None or eng not in _active_engines():
            return
        st = eng._thread()
        st.excluded_depth += 1
        st.region_stack.append(mod)
        handle.fired += 1

    @torch._dynamo.disable
    def post(mod: nn.Module, args: Any, out: Any) -> None:
        eng = eng_ref()
        if eng is None:
            return
        st = eng._thread()
        for i in range(len(st.region_stack) - 1, -1, -1):
            if st.region_stack[i] is mod:
                del st.region_stack[i]
                st.excluded_depth -= 1
                if keep_after:
                    st.after_head = True
                return

    hooks = [
        module.register_forward_pre_hook(pre),
        # always_call: the depth is restored even when the module's forward raises.
        module.register_forward_hook(post, always_call=True),
    ]
    if keep_after:
        if root is None and engine._model_ref is not None:
            root = engine._model_ref()
        if root is not None and root is not module:

            @torch._dynamo.disable
            def new_call(mod: nn.Module, args: Any) -> None:
                eng = eng_ref()
                if eng is not None:
                    eng._thread().after_head = False

            hooks.append(root.register_forward_pre_hook(new_call))
    handle = RegionHandle(hooks, name=type(module).__name__)
    engine._regions.append(handle)
    weakref.finalize(engine, handle.remove)
    return handle


def keep_after_module(engine: "OffloadActivations", module: nn.Module) -> RegionHandle:
    """Keep what is saved after ``module``'s forward returns, until its next call (reason ``after_head``).

    For a model's body (``find_backbone``): whatever runs on its output (the
    head, the loss) is kept even when no head module runs, as with TRL's
    SFTTrainer, which multiplies by ``lm_head.weight`` itself (a fused,
    chunked head). The state is the one ``exclude_module(keep_after=True)``
    sets, so the engine's outermost entry resets it too.
    """
    eng_ref = weakref.ref(engine)

    @torch._dynamo.disable
    def pre(mod: nn.Module, args: Any) -> None:
        eng = eng_ref()
        if eng is not None and eng in _active_engines():
            eng._thread().after_head = False

    @torch._dynamo.disable
    def post(mod: nn.Module, args: Any, out: Any) -> None:
        eng = eng_ref()
        if eng is not None and eng in _active_engines():
            eng._thread().after_head = True
            handle.fired += 1

    hooks = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    handle = RegionHandle(hooks, name=f"after {type(module).__name__}")
    engine._regions.append(handle)
    weakref.finalize(engine, handle.remove)
    return handle


def find_backbone(model: nn.Module) -> nn.Module | None:
    """The body of a Hugging Face model with a head (``LlamaModel`` in ``LlamaForCausalLM``), or None.

    Looked through DDP / ``torch.compile`` wrappers and PEFT (``get_base_model()``);
    the body is the model's ``base_model`` when that is a submodule.
    """
    model = _unwrap(model)
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # PEFT
    body = getattr(inner, "base_model", None)
    return body if isinstance(body, nn.Module) and body is not inner else None


def _active_engines() -> list[Any]:
    from .engine import _engines

    return _engines()


def warn_unused_regions(engine: "OffloadActivations") -> None:
    """Warn once per excluded module whose forward never ran while the engine packed.

    The usual cause is a model compiled as a whole before the exclusion was
    registered: its cached graph does not run the new hooks, so the module's
    tensors are offloaded like the rest. Silence would hide exactly that.
    """
    for h in engine._regions:
        if h.active and h.fired == 0 and not h.warned and not (h.optional() if callable(h.optional) else h.optional):
            h.warned = True
            warnings.warn(
                f"OffloadActivations.exclude({h.name}): a step finished without that module's "
                "forward running under the engine, so nothing was excluded. If the model is "
                "torch.compile'd as a whole and was run before the exclusion was registered, its "
                "cached graph skips the exclusion hooks and the module's activations are offloaded. "
                "Fix: create the offload context (get_act_offloading_ctx_manager) before the first "
                "compiled call, or compile the blocks individually.",
                stacklevel=user_stacklevel(),
            )
    engine._regions = [h for h in engine._regions if h.active]


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP / DataParallel / torch.compile wrappers keep the real model inside.
    for attr in ("module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module) and inner is not model:
            return _unwrap(inner)
    return model


def find_output_head(model: nn.Module) -> nn.Module | None:
    """The module that computes the logits, or None.

    Looked for, in order: HF's ``get_output_embeddings()``, ``model.output``
    (or its ``.linear`` when ``output`` is a torchtune-style TiedLinear that is
    not itself a module), ``model.lm_head``, and a Linear whose weight is an
    Embedding's weight (a tied head).
    """
    model = _unwrap(model)
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Module):
            return head
    for name in ("output", "lm_head"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
        inner = getattr(head, "linear", None)
        if isinstance(inner, nn.Module):
            return inner
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tied = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) in embeddings]
    if tied:
        return tied[-1]
    return None


def exclude_output_head(engine: "OffloadActivations", model: nn.Module) -> list[RegionHandle]:
    """Keep ``model``'s output head, and what runs after it, on ``engine``'s device; [] if no head is found.

    The head (``find_output_head``) is excluded with ``keep_after=True`` until
    ``model``'s next call, so the loss computed on its output stays too. For a
    Hugging Face model, what runs after its body (``find_backbone``) is kept as
    well: a fused head never runs the head module (TRL's SFTTrainer). The
    handles' ``remove()`` undo it.
    """
    head = find_output_head(model)
    if head is None:
        return []
    region = exclude_module(engine, head, keep_after=True, root=model)
    handles = [region]
    body = find_backbone(model)
    root = _unwrap(model)
    if body is not None:
        after_body = keep_after_module(engine, body)
        handles.append(after_body)
        # Two ways to keep the same tail: either one running is enough, and only neither running is
        # a sign of a stale compiled graph. The head alone runs when the model calls a part of its
        # body directly (OPTForCausalLM calls self.model.decoder, never self.model); the body alone
        # when no head module runs (TRL's fused head).
        region.optional = True
        after_body.optional = lambda: region.fired > 0
    elif hasattr(root, "skip_output_layer"):
        # torchtune's LinearCrossEntropyLoss sets model.skip_output_layer and projects
        # through the head itself, in the loss, outside the context: no head runs by design.
        root_ref = weakref.ref(root)
        region.optional = lambda: bool(getattr(root_ref(), "skip_output_layer", False))
    log.info("%s: output head %s excluded%s", type(model).__name__, type(head).__name__,
             f", and what runs after {type(body).__name__}" if body is not None else "")
    return handles


def get_act_offloading_ctx_manager(
    model: nn.Module,
    enable_activation_offloading: bool = True,
    *,
    warn_if_no_head: bool = True,
    **kwargs: Any,
) -> "OffloadActivations | contextlib.nullcontext":
    """An OffloadActivations for ``model`` with its output head excluded (torchtune's and TRL's API).

    torchtune calls it as ``(model, enable_activation_offloading)``; TRL as
    ``(model=..., use_pin_memory=..., use_streams=..., min_offload_size=...,
    max_fwd_stash_size=..., warn_if_no_head=...)`` with no enable flag (so it
    defaults to True). ``kwargs`` go to OffloadActivations unchanged
    (``config=`` included; ``model`` defaults to this model so its parameters
    and buffers are known up front). Returns a null context when offloading is
    disabled. Warns, with the fix, when no head is found (unless
    ``warn_if_no_head=False``).
    """
    if not isinstance(enable_activation_offloading, bool):
        raise TypeError(
            f"get_act_offloading_ctx_manager: enable_activation_offloading="
            f"{enable_activation_offloading!r} is not a bool (got "
            f"{type(enable_activation_offloading).__name__}). The second positional argument is "
            "torchtune's enable flag; pass other settings by name, or use offload.compat.trl for "
            "TRL's signature."
        )
    if not enable_activation_offloading:
        return contextlib.nullcontext()
    from .engine import OffloadActivations

    kwargs.setdefault("model", model)
    ctx = OffloadActivations(**kwargs)
    handles = exclude_output_head(ctx, model)
    if not handles and warn_if_no_head:
        warnings.warn(
            f"get_act_offloading_ctx_manager: no output head found on {type(model).__name__} "
            "(looked for get_output_embeddings(), .output, .lm_head and a Linear tied to an "
            "Embedding), so the head's activations will be offloaded too: they are needed first "
            "in backward, so their reload cannot overlap compute and costs step time for little "
            "memory. Fix: call ctx.exclude(<your head module>) on the returned context, or pass "
            "warn_if_no_head=False if the model has no such head.",
            stacklevel=user_stacklevel(),
        )
    return ctx
