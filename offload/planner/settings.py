"""The settings of a plan's ``OffloadActivations``, read from ``offload.plan``'s arguments as the engine reads them."""

from __future__ import annotations

from typing import Any

import torch

from ..config import SIZE_FIELDS, size_setting
from ..sizes import SizeLike

__all__ = ["engine_settings", "parsed", "synchronous"]


def engine_settings(engine_kwargs: dict[str, Any] | None, host_budget_bytes: SizeLike | None,
                    min_offload_size: SizeLike, use_streams: bool, dev: torch.device) -> dict[str, Any]:
    """The settings of the plan's ``OffloadActivations``: ``engine_kwargs`` and the arguments of
    :func:`plan` that are engine settings, sizes in bytes (the host tiers' limits are read from them)."""
    ekw = {k: size_setting(k, v, owner="offload.plan", label=f"engine_kwargs[{k!r}]") if k in SIZE_FIELDS
           else v for k, v in (engine_kwargs or {}).items()}
    ekw = parsed(ekw)  # names and values checked as the engine checks them (did you mean)
    min_offload_size = size_setting("min_offload_size", min_offload_size, owner="offload.plan")
    if host_budget_bytes is not None:  # issue 25: the plan's copies must fit the host tiers
        host_budget_bytes = size_setting("host_budget_bytes", host_budget_bytes, owner="offload.plan")
        if "host_budget_bytes" in ekw:
            raise ValueError("offload.plan: host_budget_bytes given both as an argument and in engine_kwargs.")
        ekw["host_budget_bytes"] = host_budget_bytes
    ekw.setdefault("min_offload_size", min_offload_size)
    ekw.setdefault("use_streams", use_streams)
    if synchronous(dev, ekw):
        # Synchronous copies gain nothing from loading ahead, and a prefetch reaches
        # across blocks (into the previous offloaded block), which no per-block cost has.
        ekw.setdefault("prefetch_bytes", 0)
    return ekw


def parsed(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` as the engine reads them (issue 31): checked and parsed by ``OffloadConfig``
    (sizes with units such as "64KiB" become ints, a typo gets "did you mean"), before any step runs."""
    from ..config import OffloadConfig

    try:
        cfg = OffloadConfig(**engine_kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"offload.plan: engine_kwargs: {e}") from None
    return {k: getattr(cfg, k) for k in engine_kwargs}


def synchronous(dev: torch.device, ekw: dict[str, Any]) -> bool:
    """Whether the plan's engine copies synchronously (on CPU, or without side streams)."""
    return dev.type == "cpu" or not ekw["use_streams"]
