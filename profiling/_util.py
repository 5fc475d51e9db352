"""Small helpers shared by the profilers: rank, host memory, name resolution, plain data."""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import psutil
import torch

def host_rss(proc: psutil.Process | None = None) -> int:
    """Resident set size in bytes (``memory_info().rss``, ~10 us with a reused handle)."""
    return (proc or psutil.Process()).memory_info().rss


def get_rank() -> int:
    """Global rank: the process group's if one is initialised, else ``$RANK``, else 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def get_world_size() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _identity(x: Any) -> Any:
    return x


IDENTITY_NAMES = ("identity", "identity_lambda")


def resolve_callable(spec: str | Callable, where: str) -> Callable:
    """Turn ``"package.module.function"`` (or a callable) into a callable.

    ``where`` names the setting, e.g. ``"MemProfilerCfg.memory_hooks.pre_forward_hooks"``,
    so a bad value is reported against the field the user wrote it in.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(
            f"{where}: expected a callable or a 'package.module.function' string, "
            f"got {type(spec).__name__} {spec!r}"
        )
    if spec in IDENTITY_NAMES:
        return _identity
    mod_name, _, attr = spec.rpartition(".")
    if not mod_name:
        raise ValueError(
            f"{where}: {spec!r} is not a function path; write it as 'package.module.function' "
            f"(or use one of {IDENTITY_NAMES})"
        )
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{where}: cannot import module {mod_name!r} for {spec!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(
            f"{where}: module {mod_name!r} has no callable named {attr!r} (from {spec!r})"
        )
    return fn


def to_plain(obj: Any) -> Any:
    """Convert to data ``yaml.safe_dump`` and ``json.dump`` accept: dict/list/str/int/float/bool/None."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=str) if isinstance(obj, (set, frozenset)) else obj
        return [to_plain(v) for v in items]
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, (torch.device, torch.dtype)):
        return str(obj)
    if hasattr(obj, "item"):  # numpy scalars
        try:
            return to_plain(obj.item())
        except (TypeError, ValueError):
            pass
    return str(obj)


def flatten(prefix: str, obj: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Flatten nested mappings into ``out`` with dotted keys (``prefix.a.b``)."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = to_plain(obj)
    return out
