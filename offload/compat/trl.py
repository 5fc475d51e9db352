"""TRL's activation-offloading API with its exact signatures (positional order included).

Replace ``from trl.models.activation_offloading import OffloadActivations,
NoOpManager, get_act_offloading_ctx_manager`` (and ``from trl.models import
enable_selective_activation_checkpointing``) with an import from here. See
NOTE [ Positional peers ] in ``offload.compat``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any

import torch
from torch import nn

from .._warn import user_stacklevel
from ..config import OffloadConfig, check_keywords
from ..engine import OffloadActivations as _Engine
from ..regions import NoOpManager
from ..regions import get_act_offloading_ctx_manager as _get_ctx

__all__ = [
    "OffloadActivations",
    "NoOpManager",
    "get_act_offloading_ctx_manager",
    "enable_selective_activation_checkpointing",
    "patch_sft_trainer",
    "SFTTrainerPatch",
]

logger = logging.getLogger(__name__)


class OffloadActivations(_Engine):
    """``offload.OffloadActivations`` taking TRL's positional order.

    ``(use_pin_memory, use_streams, min_offload_size, max_fwd_stash_size)``;
    every other setting by keyword, as in the main class. ``max_fwd_stash_size`` defaults to None (no
    cap: TRL's 5 made compute wait on the oldest copy beyond five; NOTE [ Copy schedule ] waits only
    where device memory needs it); a value given is kept as a cap. TRL's attributes
    (``update_model_params``, ``param_storages``, ``tracker``, ``tensor_id``,
    ``storage_to_tensor_id``) come with the main class: see
    NOTE [ Peer attributes are views ] in ``offload/compat/_peer_attributes.py``.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_size: int = 1024,
        max_fwd_stash_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(use_pin_memory, use_streams, max_fwd_stash_size=max_fwd_stash_size,
                         min_offload_size=min_offload_size, **kwargs)


def get_act_offloading_ctx_manager(
    model: nn.Module,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = 1024,
    max_fwd_stash_size: int | None = None,
    warn_if_no_head: bool = True,
    **kwargs: Any,
) -> "OffloadActivations | contextlib.nullcontext":
    """TRL's helper: an engine for ``model`` with its output head excluded; TRL's positional order.

    Extra settings (``device=``, ``config=``...) go by keyword, as in
    ``offload.get_act_offloading_ctx_manager``.
    """
    return _get_ctx(
        model,
        True,
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_size=min_offload_size,
        max_fwd_stash_size=max_fwd_stash_size,
        warn_if_no_head=warn_if_no_head,
        **kwargs,
    )


class SFTTrainerPatch:
    """The handle ``patch_sft_trainer`` returns: ``engines`` built so far, ``remove()`` (or a ``with`` block)."""

    def __init__(self, module: Any, original: Any, settings: dict[str, Any]) -> None:
        self._module, self._original = module, original
        self.settings = settings
        """The engine settings every engine built through the patch gets."""
        self.engines: list[OffloadActivations] = []
        """One engine per SFTTrainer built with ``activation_offloading=True`` (each holds a ``ledger``)."""

    def _build(self, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        ctx = get_act_offloading_ctx_manager(model, *args, **{**self.settings, **kwargs})
        self.engines.append(ctx)
        return ctx

    def remove(self) -> None:
        """Give TRL its own engine back (idempotent)."""
        if getattr(self._module, "get_act_offloading_ctx_manager", None) == self._build:
            self._module.get_act_offloading_ctx_manager = self._original

    def __enter__(self) -> "SFTTrainerPatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def patch_sft_trainer(**engine_kwargs: Any) -> SFTTrainerPatch:
    """Make ``SFTConfig(activation_offloading=True)`` build this engine instead of TRL's: the one-line swap.

    ``SFTTrainer`` calls ``get_act_offloading_ctx_manager(model=...)`` from
    ``trl.trainer.sft_trainer`` when the flag is on and enters the context around
    each training step; this points that name at this module's helper (the head
    and everything after the body kept on the device), with ``engine_kwargs``
    (``OffloadConfig`` fields, checked now) added. Call it before the trainer is
    built. The engines' ledgers are in the returned handle's ``engines`` (and
    in ``trainer.maybe_activation_offload_context``).
    """
    import importlib

    check_keywords("patch_sft_trainer", ("config", *OffloadConfig.field_names()), engine_kwargs)
    if "config" not in engine_kwargs:
        OffloadConfig(**engine_kwargs)  # bad values fail here, not at the trainer's construction
    module = importlib.import_module("trl.trainer.sft_trainer")
    original = getattr(module, "get_act_offloading_ctx_manager", None)
    if original is None:
        raise ImportError(
            "patch_sft_trainer: this TRL version has no SFTConfig(activation_offloading=...) "
            "(trl.trainer.sft_trainer.get_act_offloading_ctx_manager is missing); use "
            "offload.integrations.hf.OffloadCallback instead."
        )
    if isinstance(getattr(original, "__self__", None), SFTTrainerPatch):
        original.__self__.remove()  # patched twice: the new settings win, one patch stays
        original = module.get_act_offloading_ctx_manager
    patch = SFTTrainerPatch(module, original, dict(engine_kwargs))
    module.get_act_offloading_ctx_manager = patch._build
    return patch


def _get_unique_tensor_key(tensor: torch.Tensor) -> tuple[int, torch.dtype]:
    """TRL's deduplication key: ``(storage pointer + storage offset, dtype)``; DTensor: its local shard.

    TRL's tests and patches reach for this module-level name; our engine keys
    its own deduplication by storage and byte span (``dedupe=``), not by it.
    """
    local = getattr(tensor, "_local_tensor", None)
    t = local if isinstance(local, torch.Tensor) else tensor
    try:
        ptr = t.untyped_storage().data_ptr() + t.storage_offset()
    except (RuntimeError, NotImplementedError, TypeError):
        ptr = id(t)  # no reachable storage: never equal to another tensor's key
    return ptr, t.dtype


# The attention operators selective checkpointing saves: torch's fused SDPA
# kernels (whichever this torch build has), matched by identity at the dispatcher.
_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_attention_math_for_mps",
)


def _attention_policy() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    ops = frozenset(
        packet.default for name in _ATTENTION_OPS if (packet := getattr(torch.ops.aten, name, None)) is not None
    )

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        # flash-attn's own kernels register under hashed namespaces: matched by name.
        if op in ops or "flash_attn" in str(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointing_entry(model: nn.Module) -> tuple[str, str]:
    """The method that turns checkpointing on, and its kwargs' name (transformers 5 renamed both)."""
    if callable(getattr(model, "activation_checkpointing_enable", None)):
        # transformers >= 5: gradient_checkpointing_enable (deprecated) calls this one.
        return "activation_checkpointing_enable", "activation_checkpointing_kwargs"
    return "gradient_checkpointing_enable", "gradient_checkpointing_kwargs"


def _checkpointing_on(model: nn.Module) -> bool:
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if isinstance(getattr(type(model), name, None), property):
            return bool(getattr(model, name))
    return False


def enable_selective_activation_checkpointing(model: nn.Module) -> None:
    """TRL's helper: checkpointing that saves attention outputs and recomputes the rest.

    Wraps the model's checkpointing switch (``activation_checkpointing_enable`` on
    transformers >= 5, which the deprecated ``gradient_checkpointing_enable``
    calls; ``gradient_checkpointing_enable`` before) so that every later call,
    by you, a Trainer or PEFT, turns on non-reentrant checkpointing with a
    selective policy (``create_selective_checkpoint_contexts``): fused attention
    kernels are saved, everything else is recomputed, so the backward runs
    attention's forward once instead of twice. Gradients are those of full
    checkpointing. Calling it again on the same model does nothing.

    Raises TypeError when ``model`` has no such switch (it is not a Hugging Face
    model). Warns when checkpointing is already on: enable it again for the
    policy to take effect.
    """
    name, kwargs_name = _checkpointing_entry(model)
    enable = getattr(model, name, None)
    if not callable(enable):
        raise TypeError(
            f"enable_selective_activation_checkpointing: {type(model).__name__} has no "
            "activation_checkpointing_enable() or gradient_checkpointing_enable() (a Hugging Face "
            "PreTrainedModel has them). For another model, pass context_fn=functools.partial("
            "torch.utils.checkpoint.create_selective_checkpoint_contexts, policy) to "
            "torch.utils.checkpoint.checkpoint."
        )
    if getattr(enable, "_offload_sac", False):
        return
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context_fn = functools.partial(create_selective_checkpoint_contexts, _attention_policy())

    @functools.wraps(enable)
    def enable_selective(checkpoint_kwargs: dict | None = None, *args: Any, **kwargs: Any) -> Any:
        for alias in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
            if alias in kwargs:
                checkpoint_kwargs = kwargs.pop(alias)
        ckpt = dict(checkpoint_kwargs or {})
        if ckpt.get("use_reentrant"):
            logger.info("selective checkpointing needs use_reentrant=False; overriding use_reentrant=True")
        ckpt["use_reentrant"] = False  # selective policies act on saved tensors: non-reentrant only
        ckpt["context_fn"] = context_fn
        return enable(*args, **{kwargs_name: ckpt}, **kwargs)

    enable_selective._offload_sac = True  # type: ignore[attr-defined]
    setattr(model, name, enable_selective)
    if _checkpointing_on(model):
        warnings.warn(
            f"enable_selective_activation_checkpointing: checkpointing is already on for "
            f"{type(model).__name__}, with the policy it was enabled with. Call "
            f"model.{name}() again (or enable selective checkpointing first) for attention "
            "outputs to be saved.",
            stacklevel=user_stacklevel(),
        )
