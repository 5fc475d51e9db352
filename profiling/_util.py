"""Small helpers shared by the profilers: rank, host memory, name resolution, plain data."""

from __future__ import annotations

import dataclasses
import math
import pkgutil
import os
from collections.abc import Callable, Mapping
from typing import Any

import psutil
import torch

def host_rss(proc: psutil.Process | None = None) -> int:
    """Resident set size in bytes (``memory_info().rss``, ~10 us with a reused handle)."""
    return (proc or psutil.Process()).memory_info().rss


_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "JSM_NAMESPACE_RANK", "LOCAL_RANK",
              "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
"""Where launchers put the rank: global ones first (torchrun, SLURM, Open MPI, MPICH/Intel MPI, LSF),
then local ones, which at least keep the ranks of one node apart."""
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                    "JSM_NAMESPACE_LOCAL_RANK")
_WORLD_SIZE_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "JSM_NAMESPACE_SIZE")


def _env_int(names: tuple[str, ...], default: int) -> int:
    for n in names:
        v = os.environ.get(n, "").strip()
        if v:
            try:
                return int(v)
            except ValueError:
                continue
    return default


def get_rank() -> int:
    """Global rank: the process group's if one is initialised, else the first launcher variable set
    (``RANK``, ``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ``JSM_NAMESPACE_RANK``, then
    the local ``LOCAL_RANK`` and the like), else 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _env_int(_RANK_VARS, 0)


def get_local_rank() -> int:
    return _env_int(_LOCAL_RANK_VARS, 0)


def get_local_world_size() -> int:
    return _env_int(("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"), 1)


def get_world_size() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _env_int(_WORLD_SIZE_VARS, 1)


def _identity(x: Any) -> Any:
    return x


IDENTITY_NAMES = ("identity", "identity_lambda")

_FTS_HOOKS = "fts_examples.profiling.npp_hooks."
FTS_ALIASES: dict[str, str] = {
    _FTS_HOOKS + "_hook_npp_pre_forward": "offload.profiling.hooks.npp_rss_pre_forward",
    _FTS_HOOKS + "_hook_npp_post_forward": "offload.profiling.hooks.npp_rss_post_forward",
    _FTS_HOOKS + "_reset_memory_hooks_state": "offload.profiling.hooks.reset_memory_hooks_state",
    _FTS_HOOKS + "_npp_hook": "identity",
}
"""finetuning-scheduler's default hook paths -> this package's equivalents, so FTS YAML configs load
without FTS installed. Its npp pack hook becomes identity: the profiler's own byte counter already
counts npp (without shadowing an offload engine), so chaining FTS's global counter would add nothing."""


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
    spec = FTS_ALIASES.get(spec, spec)
    if spec in IDENTITY_NAMES:
        return _identity
    if "." not in spec and ":" not in spec:
        raise ValueError(
            f"{where}: {spec!r} is not a function path; write it as 'package.module.function' "
            f"(or use one of {IDENTITY_NAMES})"
        )
    try:
        fn = pkgutil.resolve_name(spec)  # 'pkg.mod.func', 'pkg.mod:Class.method'
    except ImportError as e:
        raise ValueError(f"{where}: cannot import the module of {spec!r}: {e}") from e
    except (AttributeError, ValueError) as e:
        raise ValueError(f"{where}: {spec!r} names no callable: {e}") from e
    if not callable(fn):
        raise ValueError(f"{where}: {spec!r} is a {type(fn).__name__}, not a callable")
    return fn


def to_plain(obj: Any) -> Any:
    """The one conversion to data ``json.dump`` (strict: ``allow_nan=False``) and ``yaml.safe_dump`` accept.

    Dataclasses become their fields plus their properties (derived metrics), mappings and sequences
    recurse, a non-finite float becomes None (strict JSON has no NaN; None reads as "not measured"),
    tensors of one element and numpy scalars their value, devices and dtypes their name.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        for name in dir(type(obj)):
            if isinstance(getattr(type(obj), name, None), property):
                out[name] = to_plain(getattr(obj, name))
        return out
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=str) if isinstance(obj, (set, frozenset)) else obj
        return [to_plain(v) for v in items]
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return to_plain(obj.item())
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
