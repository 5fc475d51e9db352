"""A training step whose model returns a KV cache: found, measured, and named to the user.

A Hugging Face model built from a config is in training mode with ``use_cache=True``: its forward then
returns ``past_key_values``, a cache that holds every layer's keys and values until the output is dropped.
A training step never reads it, but while it lives those keys and values stay on the device whatever the
engine does with them (an offloaded copy frees nothing; under activation checkpointing they outlive the
recompute). The HF Trainer turns it off under its own checkpointing; torchtune and torchtitan models have
none; a user who offloads or checkpoints with this project keeps it unless told. So:

- the engine warns once (per engine) when a model's output, in a step it is entered for with grad enabled,
  carries a non-empty cache, naming the bytes held and ``use_cache=False``;
- ``offload.predict`` counts the cache's blocks as their own category (``kv_cache``) and says so in the
  prediction's assumptions.

Both see the output through ``offload.modules.OUTPUT_OBSERVERS`` (the outermost module call on a tracked
thread), so no forward hook is installed on any model.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ._format import format_bytes
from ._observers import active_engine
from ._warn import warn_user
from .modules import OUTPUT_OBSERVERS

__all__ = ["returned_cache", "cache_tensors", "cache_bytes", "install_warning"]

_MAX_DEPTH = 5
"""How deep ``cache_tensors`` looks into a cache object (layers -> layer -> keys: 3 in transformers 5)."""


def returned_cache(output: Any) -> Any:
    """The KV cache a module's output carries (a ``ModelOutput`` or a dict: ``cache`` or ``past_key_values``),
    or None. A key is looked up only when present (an old name read on a new ``ModelOutput`` logs a
    deprecation)."""
    fields = getattr(type(output), "__dataclass_fields__", {})
    if isinstance(output, dict):
        if "cache" in output or "cache" in fields:  # transformers >= 5: the old name is a deprecated alias
            return output.get("cache")
        return output.get("past_key_values")
    return getattr(output, "past_key_values", None) if "past_key_values" in fields else None


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The non-empty tensors a cache object holds (a transformers ``Cache``, a tuple of per-layer (key, value)
    tuples, or any object whose attributes hold them), each storage once."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    storages: set[int] = set()

    def walk(x: Any, depth: int) -> None:
        if id(x) in seen or depth > _MAX_DEPTH:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.numel():
                try:
                    key = x.untyped_storage()._cdata
                except (RuntimeError, NotImplementedError, AttributeError):  # a subclass without one storage
                    key = id(x)
                if key not in storages:
                    storages.add(key)
                    out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y, depth + 1)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y, depth + 1)
        elif not isinstance(x, (str, bytes, int, float, bool, type(None), nn.Module, torch.dtype, torch.device)) \
                and hasattr(x, "__dict__"):
            for y in vars(x).values():
                walk(y, depth + 1)

    walk(cache, 0)
    return out


def cache_bytes(cache: Any) -> int:
    """Bytes of the distinct storages a cache object holds."""
    return sum(t.untyped_storage().nbytes() for t in cache_tensors(cache))


_warned: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _warn_engine(module: nn.Module, output: Any) -> None:
    """``OUTPUT_OBSERVERS`` entry: the engine's one warning about a returned cache."""
    if not torch.is_grad_enabled():
        return
    cache = returned_cache(output)
    if cache is None:
        return
    engine = active_engine()
    if engine is None or engine in _warned:
        return
    nbytes = cache_bytes(cache)
    if not nbytes:
        return
    _warned.add(engine)
    warn_user(
        f"OffloadActivations: {type(module).__name__} returned a KV cache (past_key_values / cache) holding "
        f"{format_bytes(nbytes)} of keys and values on the device in a training step. A training step never reads "
        "it, and while the output lives it keeps every layer's keys and values on the device, offloaded or "
        "checkpointed ones too (their offloaded copies then free nothing). Pass use_cache=False to the model call "
        "(or set model.config.use_cache = False before training).")


def install_warning() -> None:
    """Register the engine's warning about a returned cache (once; ``offload.engine`` calls it on import)."""
    if _warn_engine not in OUTPUT_OBSERVERS:
        OUTPUT_OBSERVERS.append(_warn_engine)
