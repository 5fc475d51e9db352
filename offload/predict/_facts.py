"""What a capture learns from the model beyond its ops: its output head, its state's dtype, a KV cache it returns.

NOTE [ Model facts ]
1. The head. ``offload.regions.find_output_head`` names the output head (as the engine's head exclusion
   finds it); its ``out_features`` is the vocabulary. A block made outside the model's modules (not in the
   optimizer step) whose tensor's last dimension is the vocabulary is ``logits``: the loss computed on the
   logits outside the model (an upcast, a log-softmax) and the logits' gradients in backward.
2. The state's dtype: the floating dtype of most of the model's parameter bytes, as built and cast (what
   the report names as the dtype of parameters, gradients and optimizer state).
3. A KV cache. When an outermost module call returns a non-empty cache (``past_key_values`` / ``cache``:
   a Hugging Face model with ``use_cache=True``), the blocks it holds are ``kv_cache``; so are those it
   holds after any later module call, such as what a recompute appends in backward (the cache is followed
   by a weak reference, so following it keeps nothing alive). ``kv_cache_bytes`` is the most it held.
   The output is seen through ``offload.modules.OUTPUT_OBSERVERS`` (``offload._kv_cache``).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._kv_cache import cache_tensors, returned_cache
from ..modules import OUTPUT_OBSERVERS, module_name
from ..regions import find_output_head

__all__ = ["ModelFacts", "watching_outputs"]


@contextlib.contextmanager
def watching_outputs(observe: Callable[[nn.Module, Any], None]) -> Iterator[None]:
    """While inside: ``observe(module, output)`` after each outermost module call (item 3), and the engine's own
    warning about a returned KV cache silenced (the prediction reports the cache itself)."""
    OUTPUT_OBSERVERS.append(observe)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"OffloadActivations: \w+ returned a KV cache")
            yield
    finally:
        OUTPUT_OBSERVERS.remove(observe)


class ModelFacts:
    """The head, the state's dtype and the KV cache of the model a capture runs (NOTE [ Model facts ]), and the
    autocast its step ran under."""

    def __init__(self) -> None:
        self.head_name = ""
        """The output head's module name, as the engine's records name it ('' without a head)."""
        self.vocab = 0
        """The head's ``out_features`` (0: no head found)."""
        self.state_dtype: torch.dtype | None = None
        self.kv_cache_bytes = 0
        """The most bytes a KV cache the model returned held (0: none returned)."""
        self.autocast: torch.dtype | None = None
        """The dtype of an autocast the step ran under (``mixed_precision``'s, or the step's own: NOTE [ Mixed
        precision ] item 4 in ``_mixed.py``); None: none."""
        self._cache: Any = None

    def read(self, model: nn.Module) -> None:
        """Learn the head and the state's dtype of the built model (items 1 and 2)."""
        by_dtype: dict[torch.dtype, int] = {}
        for t in model.parameters():
            if t.is_floating_point():
                by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.numel() * t.element_size()
        self.state_dtype = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else None
        head = find_output_head(model)
        if head is not None:
            self.head_name = module_name(head)
            self.vocab = int(getattr(head, "out_features", 0) or 0)

    def is_logits(self, t: torch.Tensor | None) -> bool:
        """``t`` has the vocabulary as its last dimension (item 1)."""
        return bool(self.vocab) and t is not None and t.dim() > 0 and t.shape[-1] == self.vocab

    def on_output(self, output: Any, mark: Callable[[list[torch.Tensor], str], None]) -> None:
        """An outermost module call returned ``output``: mark what a KV cache holds as ``kv_cache`` (item 3)."""
        cache = returned_cache(output)
        if cache is not None:
            try:
                self._cache = weakref.ref(cache)
            except TypeError:  # a tuple of tuples: marked now only
                self._cache = None
        elif self._cache is not None:
            cache = self._cache()
        if cache is None:
            return
        tensors = cache_tensors(cache)
        mark(tensors, "kv_cache")
        self.kv_cache_bytes = max(self.kv_cache_bytes, sum(t.numel() * t.element_size() for t in tensors))
