"""Tiled MLP and tiled loss: one layer's MLP intermediates and the full logits are never alive at once.

    handle = offload.tile_mlp(model)            # each block's MLP, in tiles of `hidden size` tokens
    loss_handle = offload.tile_loss(model)      # an HF causal LM's labels= loss, in tiles of tokens
    ...train...
    handle.remove(); loss_handle.remove()       # the model exactly as before

NOTE [ Tiles ]
At long context the largest tensors of a step are two that only exist per token: the MLP's
intermediates (Llama-3.1-8B: 3 x 14,336 values a token in one layer, recomputed under activation
checkpointing) and the logits (128,256 a token; the float32 log-probabilities cross-entropy saves are
512 KB a token). Both are computed in tiles along the sequence here, as Arctic Long Sequence Training
(ALST) and Unsloth do.

1. The MLP (``tile_mlp``): forward runs the module on each tile without autograd and saves only its
   input; backward recomputes one tile at a time (forward's RNG and autocast state restored, the
   parameters swapped for detached aliases) and returns the input's and the parameters' gradients,
   summed over the tiles, through the one autograd node (``offload/_tiled_mlp.py``): each parameter gets
   one gradient per backward, so its hooks (DDP's, FSDP's) fire once and ``torch.autograd.grad`` works
   (ALST and Liger accumulate into ``.grad`` from inside backward instead, which DDP must be patched for).
   A call that fits in one tile runs the module as it is, and so does a call during which a submodule's
   forward hooks may record what it computes (``_watched_inside``: in tiles they would see detached
   pieces, twice). Other tensor arguments with the tokens first are cut with the input, and a tuple of
   results glued back (``offload/_token_call.py``); a module that mixes neighbouring tokens is refused at
   its first tiled call (``MLPRun.check_per_token``).
2. The loss (``tile_loss``, ``linear_cross_entropy``): forward keeps the log-sum-exp per token;
   backward recomputes each tile's logits (``offload/_tiled_loss.py``). On CUDA, Liger-Kernel's fused
   linear cross-entropy or cut-cross-entropy runs instead when installed (``impl``; ``stats()`` says
   which ran).
3. Numerics. Per token the math is the untiled math. The MLP's output and input gradient are bitwise
   equal to the untiled module's on CPU (tests); the parameter gradients sum over tokens, and the tiles
   change that reduction's order: each tile's gradient is summed in float32, so they match within float
   rounding (fp32: ~1e-6 relative; bf16 compute: one bf16 rounding per tile's partial sum). The loss
   sums tokens in another order too: loss and every gradient within float rounding.
4. Accounting. Each backpropagated call adds to its engine's ledger (``summary()["tiling"]``, per kind:
   calls, tiles, ``bytes_not_saved``) and to ``handle.stats()``. The MLP's ``bytes_not_saved`` is measured:
   the activations a tile's recompute saves (not its input, a parameter, or a view or cast of one), summed
   over the tiles: what the untiled module saves from forward to backward. The loss's is counted:
   ``tokens x vocabulary x 4`` (the float32 log-probabilities cross-entropy saves) less the 4 bytes a token
   of log-sum-exp the tiles keep. The engine is the one given (``engine=``), else the one entered around
   the tiled call's forward, else none (the handle still counts).
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._logits_watch import LogitsWatch
from ._fake import is_fake
from ._observers import active_engine
from ._torch_private import graph_task_id
from ._tiled_loss import LOSS_IMPLS, _positive, cross_entropy_tiles, select_loss_impl
from ._tiled_mlp import MLPRun, TiledMLP
from ._token_call import TokenCall
from ._warn import warn_user
from .errors import OffloadError
from .regions import _unwrap, find_output_head

__all__ = ["TilingHandle", "tile_mlp", "tile_loss", "find_mlps", "linear_cross_entropy", "LOSS_IMPLS"]

log = logging.getLogger(__name__)


class TilingHandle:
    """What ``tile_mlp`` / ``tile_loss`` installed: ``remove()`` undoes it, ``stats()`` counts it."""

    def __init__(self, kind: str, engine: Any = None) -> None:
        self.kind = kind
        """``"mlp"`` or ``"loss"``."""
        self._engine = weakref.ref(engine) if engine is not None else None
        self._restore: list[Callable[[], None]] = []
        self._stats = {"calls": 0, "tiles": 0, "bytes_not_saved": 0}
        self._decided: dict[int, bool] = {}
        """id(module) -> whether its latest forward call ran untiled (``_watched``)."""
        self._per_token: set[int] = set()
        """id(module) of each module ``MLPRun.check_per_token`` passed."""
        self.untiled: dict[str, int] = {}
        """MLP calls run untiled because a submodule's hooks watched them (``_watched_inside``): the
        submodule -> how many calls."""
        self.impl: str | None = None
        """The loss implementation of the last tiled call (``builtin``, ``liger``, ``cut_cross_entropy``)."""

    @property
    def engine(self) -> Any:
        """The engine whose ledger records the tiles (None: the one entered around each call)."""
        return self._engine() if self._engine is not None else None

    @property
    def active(self) -> bool:
        return bool(self._restore)

    def stats(self) -> dict[str, Any]:
        """Backpropagated tiled calls: ``calls``, ``tiles``, ``bytes_not_saved`` (NOTE [ Tiles ], item 4);
        for the loss also ``impl``. (MLP calls run untiled: ``untiled``.)"""
        out: dict[str, Any] = dict(self._stats)
        if self.kind == "loss":
            out["impl"] = self.impl
        return out

    def _watched(self, module: nn.Module, name: str) -> bool:
        """Whether this call of ``module`` (``name``) runs untiled, a submodule's hooks watching it
        (``_watched_inside``). In backward (a checkpoint's recompute) the answer is the one its forward got,
        so the recompute saves what the forward saved: transformers' hooks record only during forward."""
        if graph_task_id() != -1:
            return self._decided.get(id(module), False)
        watcher = _watched_inside(module)
        self._decided[id(module)] = bool(watcher)
        if watcher:
            self._run_untiled(module, f"{name}.{watcher}")
        return bool(watcher)

    def _check_per_token(self, module: nn.Module, run: MLPRun) -> None:
        """``run.check_per_token()`` at ``module``'s first tiled forward through this handle (not on fake or
        meta tensors, which have no values, nor while compiling)."""
        x = run.call.tensors[0]
        if (id(module) in self._per_token or graph_task_id() != -1 or x.device.type == "meta"
                or is_fake(x) or torch.compiler.is_compiling()):
            return
        run.check_per_token()
        self._per_token.add(id(module))

    def _run_untiled(self, module: nn.Module, watcher: str) -> None:
        """Count an MLP call run as it is because ``watcher`` (a submodule with hooks) would have seen tiles;
        warn at the handle's first (the step's memory is not what tiling promised)."""
        first = not self.untiled
        self.untiled[watcher] = self.untiled.get(watcher, 0) + 1
        if first:
            warn_user(f"offload.tiling.tile_mlp: {type(module).__name__} runs untiled while {watcher} has forward "
                      "hooks that may record what it computes (transformers records a mixture of experts' router "
                      "logits for the auxiliary loss, output_router_logits=True): in tiles they would see pieces "
                      "without autograd history, and that loss would lose its gradient. Its intermediates are saved "
                      "untiled; set output_router_logits=False, or tiled_mlp=False in offload.long_context, to "
                      "choose yourself.")

    def _engine_for_call(self) -> Any:
        eng = self.engine
        return eng if eng is not None else active_engine()

    def _recorder(self, engine: Any) -> Callable[[str, int, int], None]:
        """``record(kind_or_impl, bytes_not_saved, tiles)`` for one call whose forward saw ``engine``."""
        ref = weakref.ref(engine) if engine is not None else None

        def record(impl: str, nbytes: int, tiles: int) -> None:
            if self.kind == "loss":
                self.impl = impl
            self._stats["calls"] += 1
            self._stats["tiles"] += tiles
            self._stats["bytes_not_saved"] += nbytes
            eng = ref() if ref is not None else None
            if eng is not None:
                eng.ledger.log_tiling(self.kind, nbytes, tiles)

        return record

    def remove(self) -> None:
        """Put back every forward this handle replaced (idempotent)."""
        while self._restore:
            self._restore.pop()()

    def __enter__(self) -> "TilingHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"TilingHandle({self.kind}, active={self.active}, {self.stats()})"


def _replace_forward(handle: TilingHandle, module: nn.Module, forward: Callable, marker: str) -> None:
    """``module.forward = forward`` (an instance attribute), undone by ``handle.remove()``."""
    current = module.__dict__.get("forward")
    if getattr(current, marker, False):
        raise OffloadError(f"offload.tiling: {type(module).__name__} is already tiled ({marker.strip('_')}); "
                           "remove() the earlier handle first.")
    setattr(forward, marker, True)
    had = "forward" in module.__dict__
    module.forward = forward  # type: ignore[method-assign]

    def restore() -> None:
        if had:
            module.forward = current  # type: ignore[method-assign]
        else:
            del module.forward

    handle._restore.append(restore)


# -- the MLP ------------------------------------------------------------------------------------


_FEED_FORWARD = ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn")
"""What blocks call their feed-forward submodule, in the order looked for: ``mlp`` (Hugging Face Llama, Qwen,
Mistral, Gemma, GPT-OSS; torchtune), ``feed_forward`` (Llama 4, Jamba, LFM2, Falcon-H1; torchtitan),
``block_sparse_moe`` (Granite MoE; Mixtral and PhiMoE before transformers 5), ``moe`` (torchtitan's mixtures
of experts), ``ffn`` (MPT, CTRL)."""


def find_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Each block's feed-forward submodule (``_FEED_FORWARD``: ``mlp``, ``feed_forward``...), as (name,
    module): the blocks ``offload.plan`` finds (the model's largest ``nn.ModuleList``). A name is a guess at
    what the module does: one that mixes tokens (RWKV's ``feed_forward`` shifts them) is refused at its
    first tiled call (``MLPRun.check_per_token``)."""
    from .planner.blocks import find_blocks

    try:
        blocks = find_blocks(model)
    except ValueError as e:
        raise OffloadError(f"offload.tiling.tile_mlp: {e} Pass modules=[...] (the per-token MLP modules), or "
                           "tiled_mlp=False in offload.long_context.") from None
    found = []
    for name, b in blocks:
        key = next((k for k in _FEED_FORWARD if isinstance(getattr(b, k, None), nn.Module)), None)
        if key is not None:
            found.append((f"{name}.{key}", getattr(b, key)))
    if not found:
        kinds = sorted({type(b).__name__ for _, b in blocks})
        raise OffloadError(f"offload.tiling.tile_mlp: none of {type(model).__name__}'s {len(blocks)} blocks "
                           f"({', '.join(kinds)}) has a feed-forward submodule named "
                           f"{', '.join('.' + k for k in _FEED_FORWARD)}; pass modules=[...] (the per-token MLP "
                           "modules), or tiled_mlp=False in offload.long_context.")
    return found


def _mlp_forward(handle: TilingHandle, module: nn.Module, orig: Callable, tokens: int | None,
                 name: str) -> Callable:
    first = _first_parameter(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args:
            x, args = args[0], args[1:]
        else:
            x = kwargs.pop(first, None) if first is not None else None
        if not isinstance(x, torch.Tensor):
            raise OffloadError(f"offload.tiling.tile_mlp: {type(module).__name__}.forward was called without its "
                               f"input tensor first (got {type(x).__name__}); a tiled module takes the hidden states "
                               "first. Pass modules=[...] naming only per-token modules, or tiled_mlp=False in "
                               "offload.long_context.")
        rows = tokens if tokens is not None else x.shape[-1]  # ALST: tiles of hidden-size tokens
        if x.numel() // max(1, x.shape[-1]) <= rows:
            return orig(x, *args, **kwargs)  # one tile: nothing to spare
        if torch.is_grad_enabled() and handle._watched(module, name):
            return orig(x, *args, **kwargs)
        call = TokenCall(type(module).__name__, x, args, kwargs)
        params = [p for p in module.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
        engine = handle._engine_for_call()
        run = MLPRun(orig, module, call, rows, params,
                     lambda nbytes, tiles: handle._recorder(engine)("mlp", nbytes, tiles))
        handle._check_per_token(module, run)
        if torch.is_grad_enabled() and (any(t.requires_grad for t in call.tensors) or params):
            out = TiledMLP.apply(run, *call.tensors, *params)
            return out if isinstance(out, torch.Tensor) or run.outputs.kind is tuple else run.outputs.kind(out)
        return run.forward_tiles()

    return forward


def _first_parameter(module: nn.Module) -> str | None:
    """The name of ``module.forward``'s first parameter (its input, when passed by keyword), if it has one."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[0].name if params and params[0].kind in (params[0].POSITIONAL_OR_KEYWORD,
                                                            params[0].KEYWORD_ONLY) else None


def _watched_inside(module: nn.Module) -> str:
    """A submodule of ``module`` with forward hooks that may watch this call (its name and type), or "".

    The tiles run each submodule once per tile without autograd, and again in backward: a hook that
    records an output (transformers' output capturing: a router's logits for the auxiliary loss) would
    hold detached pieces, and the loss made from them no gradient. transformers' capturing hooks stay
    installed once a call asked for an output; one records only while a call collects its key, so an
    idle one does not count. (transformers 4.54-4.57 captured by replacing the submodule's ``forward``
    for the duration of a recording call: such a wrapper counts too.)"""
    collecting = _collected_outputs()
    for name, m in module.named_modules():
        if m is module:  # (its own hooks run around the whole tiled call)
            continue
        wrapper = getattr(m.__dict__.get("forward"), "__qualname__", "")
        if wrapper.endswith("capture_wrapper.<locals>.wrapped_forward"):
            return f"{name} ({type(m).__name__})"
        for hook in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()):
            key = _capture_key(hook)
            if key is None or key in collecting:
                return f"{name} ({type(m).__name__})"
    return ""


def _collected_outputs() -> frozenset[str]:
    """The outputs transformers collects in the running forward (``output_router_logits`` ...), if any."""
    mod = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(mod, "_active_collector", None)
    got = collector.get() if collector is not None else None
    return frozenset(got) if isinstance(got, dict) else frozenset()


def _capture_key(hook: Callable) -> str | None:
    """The output a transformers output-capturing hook records (its closure's ``key``); None for any other
    hook."""
    if not getattr(hook, "__qualname__", "").endswith("_hook.<locals>.output_capturing_hook"):
        return None
    cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
    key = cells.get("key")
    return key.cell_contents if key is not None and isinstance(key.cell_contents, str) else None


def tile_mlp(model: nn.Module, *, tokens: int | None = None, modules: list[nn.Module] | None = None,
             engine: Any = None) -> TilingHandle:
    """Compute each block's MLP in tiles of ``tokens`` tokens (default: the hidden size, as ALST), with
    recompute in backward (NOTE [ Tiles ]). ``modules``: the per-token modules to tile instead of each
    block's MLP (``find_mlps``). ``engine``: whose ledger records the tiles (default: the one entered around
    each call). Returns a handle; ``remove()`` puts the modules back exactly."""
    if tokens is not None:
        _positive("tokens", tokens)
    found = find_mlps(model) if modules is None else [(type(m).__name__, m) for m in modules]
    handle = TilingHandle("mlp", engine)
    try:
        for name, m in found:
            if not isinstance(m, nn.Module):
                raise TypeError(f"offload.tiling.tile_mlp: modules must be nn.Modules, got {type(m).__name__}")
            _replace_forward(handle, m, _mlp_forward(handle, m, m.forward, tokens, name),
                             "__offload_tiled_mlp__")
    except BaseException:
        handle.remove()
        raise
    log.info("offload.tiling: %d MLP modules of %s tiled (%s tokens a tile)", len(found), type(model).__name__,
             tokens if tokens is not None else "hidden-size")
    return handle


# -- the loss ---------------------------------------------------------------------------------------


def linear_cross_entropy(hidden: torch.Tensor, head: nn.Module | torch.Tensor, targets: torch.Tensor, *,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                         tokens: int | None = None, impl: str = "auto", engine: Any = None) -> torch.Tensor:
    """``F.cross_entropy(head(hidden).float(), targets, ignore_index=..., reduction=...)`` in tiles of tokens,
    without the full logits: the tiled loss for your own training step (``tile_loss`` does it inside a
    Hugging Face model). ``hidden`` (..., H) is the head's input, ``head`` an ``nn.Linear`` or its weight
    (V, H) (then ``bias`` its bias), ``targets`` (...) class indices, ``ignore_index`` ones left out;
    ``reduction`` "mean" (over the labelled tokens) or "sum"; ``tokens`` per tile (default: a tile's logits
    no larger than all the hidden states, and at most 256 MiB in float32); ``impl``: ``LOSS_IMPLS``. Each
    backward adds to the ledger of ``engine`` (default: the one entered around this call; NOTE [ Tiles ])."""
    eng = engine if engine is not None else active_engine()
    ref = weakref.ref(eng) if eng is not None else None

    def record(impl_ran: str, nbytes: int, tiles: int) -> None:
        e = ref() if ref is not None else None
        if e is not None:
            e.ledger.log_tiling("loss", nbytes, tiles)

    return cross_entropy_tiles(hidden, head, targets, bias=bias, ignore_index=ignore_index, reduction=reduction,
                               tokens=tokens, impl=impl, record=record if ref is not None else None)


# -- the loss of a Hugging Face causal LM (labels=) ---------------------------------------------------


def _causal_lm(model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM inside ``model`` (DDP, ``torch.compile`` and PEFT wrappers looked through)."""
    lm = _unwrap(model)
    if callable(getattr(lm, "get_base_model", None)):
        lm = _unwrap(lm.get_base_model())
    return lm


def _check_causal_lm(lm: nn.Module) -> nn.Module:
    """The head of a causal LM whose labels= loss ``tile_loss`` reproduces, or a clear error."""
    name = type(lm).__name__
    try:
        from transformers import PreTrainedModel
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:
        PreTrainedModel, LOSS_MAPPING = None, {}
    if PreTrainedModel is None or not isinstance(lm, PreTrainedModel):
        raise OffloadError(
            f"offload.tiling.tile_loss: {name} is not a Hugging Face model; tile_loss tiles the loss a causal LM "
            "computes from labels=. With your own loss, call offload.tiling.linear_cross_entropy(hidden, head, "
            "targets) on the head's input instead of computing the logits.")
    head = find_output_head(lm)
    if head is None or type(head).forward is not nn.Linear.forward:
        raise OffloadError(f"offload.tiling.tile_loss: {name}'s output head is "
                           f"{type(head).__name__ if head is not None else 'not found'}, not a plain nn.Linear "
                           "(a LoRA-wrapped head is not: leave lm_head out of the adapter's target modules).")
    _check_loss_function(lm, LOSS_MAPPING.get("ForCausalLM"))
    return head


def _check_loss_function(lm: nn.Module, causal_lm_loss: Callable | None) -> None:
    """Refuse a model whose ``loss_function`` is not transformers' ``ForCausalLMLoss`` (checked when tiled and
    at every tiled call: a ``model.loss_function = ...`` set later would otherwise be replaced by the tiles)."""
    if lm.loss_function is not causal_lm_loss:
        raise OffloadError(f"offload.tiling.tile_loss: {type(lm).__name__}.loss_function is {lm.loss_function!r}, "
                           "not transformers' ForCausalLMLoss, whose semantics the tiles reproduce (shifted labels, "
                           "ignore_index, num_items_in_batch); leave the loss untiled or compute it with "
                           "offload.tiling.linear_cross_entropy.")


class _LabelsCall:
    """One call of the causal LM with labels: the head's input captured, the loss computed from it."""

    def __init__(self, handle: TilingHandle, lm: nn.Module, head: nn.Linear, tokens: int | None, impl: str) -> None:
        self.handle, self.head, self.tokens, self.impl = handle, head, tokens, impl
        self.model = type(lm).__name__
        self.hidden: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.engine = handle._engine_for_call()
        self.watch = LogitsWatch()
        """What the model does to the head's output before its loss (offload/_logits_watch.py)."""

    def head_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The head's forward for this call: keep its input, return zero-width logits, watched until the
        loss (what the model does to them, the tiles do to each tile's logits)."""
        self.hidden = h
        logits = h.new_empty((*h.shape[:-1], 0))
        self.watch.start(logits)
        return logits

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                      num_items_in_batch: Any = None, ignore_index: int = -100,
                      shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """transformers' ``ForCausalLMLoss`` on the captured hidden states, in tiles."""
        if self.hidden is None:
            raise OffloadError("offload.tiling.tile_loss: the model computed its loss without running its output "
                               "head; tile_loss supports causal LMs that call lm_head and then loss_function.")
        try:
            transform = self.watch.transform(logits, self.model)
        finally:
            self.watch.stop()
        if shift_labels is None:  # tokens < n predict n, as ForCausalLMLoss
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss = cross_entropy_tiles(self.hidden, self.head, shift_labels, ignore_index=ignore_index,
                                   reduction="sum" if num_items_in_batch is not None else "mean",
                                   tokens=self.tokens, impl=self.impl, record=self.handle._recorder(self.engine),
                                   transform=transform)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        self.loss = loss
        return loss


def _swap(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set an instance attribute; returns the undo (put back the instance's own, or delete ours)."""
    had, old = name in obj.__dict__, obj.__dict__.get(name)
    setattr(obj, name, value)
    return (lambda: setattr(obj, name, old)) if had else (lambda: delattr(obj, name))


def _labels_forward(handle: TilingHandle, lm: nn.Module, head: nn.Linear, orig: Callable, tokens: int | None,
                    impl: str) -> Callable:
    sig = inspect.signature(orig)
    causal_lm_loss = lm.loss_function  # (ForCausalLMLoss: _check_causal_lm checked it)

    def forward(*args: Any, **kwargs: Any) -> Any:
        labels = kwargs["labels"] if "labels" in kwargs else sig.bind_partial(*args, **kwargs).arguments.get("labels")
        if labels is None or not torch.is_grad_enabled():
            return orig(*args, **kwargs)  # inference, evaluation: the model as it is
        _check_loss_function(lm, causal_lm_loss)
        call = _LabelsCall(handle, lm, head, tokens, impl)
        undo = [_swap(head, "forward", call.head_forward), _swap(lm, "_loss_function", call.loss_function)]
        try:
            out = orig(*args, **kwargs)
        finally:
            call.watch.stop()  # (the loss stopped it already, unless the model raised or skipped its loss)
            for u in reversed(undo):
                u()
        if call.loss is None:
            raise OffloadError(f"offload.tiling.tile_loss: {type(lm).__name__}.forward ran with labels but did "
                               "not call self.loss_function; tile_loss supports causal LMs that do.")
        if isinstance(out, OrderedDict) and "logits" in out:  # a ModelOutput: logits None, as Liger and Unsloth
            OrderedDict.pop(out, "logits")
            object.__setattr__(out, "logits", None)
        return out

    return forward


def tile_loss(model: nn.Module, *, tokens: int | None = None, impl: str = "auto", engine: Any = None) -> TilingHandle:
    """Compute a Hugging Face causal LM's ``labels=`` loss in tiles of ``tokens`` tokens (default: a tile's
    logits no larger than all the hidden states, at most 256 MiB in float32) from its head's input, never
    the full logits (NOTE [ Tiles ]). Training calls with labels (grad enabled) return ``logits=None``;
    other calls run the model as it is. ``impl``: ``LOSS_IMPLS``. ``engine``: whose ledger records the
    tiles. Returns a handle; ``remove()`` undoes it.

    For your own loss on the logits, call ``linear_cross_entropy(hidden, head, targets)`` on the head's
    input (the body's last hidden state) instead of computing the logits."""
    if tokens is not None:
        _positive("tokens", tokens)
    select_loss_impl(impl, "cpu")  # a bad or missing named implementation is refused now, not at the first step
    lm = _causal_lm(model)
    head = _check_causal_lm(lm)
    handle = TilingHandle("loss", engine)
    _replace_forward(handle, lm, _labels_forward(handle, lm, head, lm.forward, tokens, impl), "__offload_tiled_loss__")
    log.info("offload.tiling: %s's labels= loss tiled (%s tokens a tile, impl=%s)", type(lm).__name__,
             tokens if tokens is not None else "default", impl)
    return handle
