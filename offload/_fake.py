"""Storage identity for fake tensors: what lets ``offload.predict`` run the real engine on shapes only.

Under ``FakeTensorMode`` every storage reports data pointer 0, so the engine's storage keys (dedupe,
parameter and buffer detection, saved spans) would all collide. A fake storage gets a unique id here
instead, the first time the engine asks for it: a number that is never reused in the process (unlike a
real address, which the allocator hands out again), so a key from a dead storage never matches a live one
(NOTE [ Offload lifetime rules ] Rule 7 in ``offload/engine.py``). The engine asks only for tensors whose
type is ``FAKE_TENSOR``; a plain tensor never reaches this module (the hot path reads ``data_ptr()``).
"""

from __future__ import annotations

import itertools

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["FAKE_TENSOR", "fake_storage_id", "is_fake"]

FAKE_TENSOR = FakeTensor
"""The fake tensor type (why private: ``torch._subclasses`` is where PyTorch keeps it; used here only)."""

_FIRST_ID = 1 << 56
"""Fake ids start far above any address a 64-bit process maps, so a fake id never equals a real pointer."""
_ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
_next = itertools.count(_FIRST_ID, 1 << 12)


def fake_storage_id(storage: torch.UntypedStorage) -> int:
    """A unique, never reused, nonzero id for a fake tensor's storage (its stand-in data pointer)."""
    sid = _ids.get(storage)
    if sid is None:
        sid = _ids[storage] = next(_next)
    return sid


def is_fake(t: torch.Tensor) -> bool:
    """``t`` is a fake tensor (shapes only, no bytes)."""
    return type(t) is FakeTensor
