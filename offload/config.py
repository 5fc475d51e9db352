"""OffloadConfig: every engine setting in one frozen, validated, serialisable object.

``OffloadActivations(**kwargs)`` builds one of these from its arguments, so
the checks below are the only place a setting is validated, whichever way
it arrives (arguments, ``config=``, a dict or a yaml file from a trainer's
config). Each error names the setting, the value and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .pool import PIN_ALLOCATORS

__all__ = ["OffloadConfig"]

ON_HOST_BUDGET = ("keep", "pageable", "raise")
_MiB = 1 << 20


def _fail(name: str, value: Any, expected: str, fix: str = "", exc: type[Exception] = ValueError) -> None:
    raise exc(
        f"OffloadConfig: {name}={value!r} is invalid: expected {expected}"
        f" (got {type(value).__name__}).{' ' + fix if fix else ''}"
    )


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(name, value, "True or False", "Pass a bool, not a string or a number.", TypeError)


def _check_int(name: str, value: Any, minimum: int, why: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, f"an int{' or None' if allow_none else ''} ({why})",
              "Pass a Python int (e.g. 1024, not '1024' or 1024.0).", TypeError)
    if value < minimum:
        _fail(name, value, f"an int >= {minimum}{' or None' if allow_none else ''} ({why})")


def _check_choice(name: str, value: Any, choices: tuple[str, ...], why: str) -> None:
    if not isinstance(value, str) or value not in choices:
        _fail(name, value, f"one of {choices} ({why})", exc=ValueError if isinstance(value, str) else TypeError)


def _normalise_device(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, torch.device)):
        _fail("device", value, "None, a device string such as 'cpu' or 'cuda:0', or a torch.device",
              "None means the current accelerator.", TypeError)
    try:
        return str(torch.device(value))
    except (RuntimeError, TypeError, ValueError) as e:
        _fail("device", value, f"a device PyTorch can parse ({e})",
              "Pass None for the current accelerator, 'cpu' to offload CPU tensors into the host "
              "pool, or e.g. 'cuda:0'.")
    return None  # unreachable


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Every setting of ``OffloadActivations`` (all its arguments but ``model``).

    Build it in code, from a trainer's config (``from_dict``, ``from_yaml``),
    and pass it as ``OffloadActivations(config=cfg)``,
    ``OffloadActivations.from_config(cfg, model=model)`` or to an integration
    callback. Values are checked when it is created.
    """

    use_pin_memory: bool = True
    """Page-lock host buffers when an accelerator is used (faster, asynchronous copies)."""
    use_streams: bool = True
    """Copy on a side stream so copies overlap compute (synchronous on CPU)."""
    max_fwd_stash_size: int = 5
    """Most tensors whose device-to-host copy may be in flight (their sources stay alive)."""
    min_offload_size: int = 1024
    """Tensors with fewer bytes than this stay on the device."""
    device: str | None = None
    """Device whose saved tensors are offloaded: None = current accelerator, "cpu" = CPU tensors."""
    max_inflight_bytes: int = 1024 * _MiB
    """Bound on bytes of in-flight device-to-host copies (their sources stay alive)."""
    prefetch_bytes: int | None = None
    """Bytes backward loads ahead of need; None = twice the largest copy (off with synchronous copies), 0 = off."""
    host_budget_bytes: int | None = None
    """Cap on host pool bytes; None = no fixed cap."""
    on_host_budget: str = "keep"
    """What a tensor that does not fit gets: "keep" (on device), "pageable" (unpooled), "raise"."""
    virtual_memory_safe_pct: float | None = 90.0
    """System RAM use in percent above which the pool allocates nothing new; None = off."""
    dedupe: bool = True
    """Share one host copy between saves of the same storage."""
    max_records: int = 10_000
    """How many per-decision records the ledger retains (totals count every record)."""
    timing: bool = True
    """Time copies (device events on accelerators, clocks on CPU)."""
    pin_allocator: str = "caching"
    """Pinned host memory: "caching" (torch's allocator) or "exact" (cudaHostRegister)."""
    native_hooks: bool = False
    """Keep path of the pack hook in C++ (offload._native; built on first use: a compiler, ninja)."""

    def __post_init__(self) -> None:
        for name in ("use_pin_memory", "use_streams", "dedupe", "timing", "native_hooks"):
            _check_bool(name, getattr(self, name))
        _check_int("max_fwd_stash_size", self.max_fwd_stash_size, 1,
                   "it bounds how many tensors may have a device-to-host copy in flight")
        _check_int("min_offload_size", self.min_offload_size, 0, "a size in bytes")
        _check_int("max_inflight_bytes", self.max_inflight_bytes, 1, "a size in bytes")
        _check_int("prefetch_bytes", self.prefetch_bytes, 0,
                   "a size in bytes; 0 turns prefetch off, None sizes it from the copies", allow_none=True)
        _check_int("host_budget_bytes", self.host_budget_bytes, 0, "a size in bytes", allow_none=True)
        _check_int("max_records", self.max_records, 0, "a count of records")
        _check_choice("on_host_budget", self.on_host_budget, ON_HOST_BUDGET,
                      "keep the tensor on the device, copy it to pageable memory, or raise OffloadError")
        _check_choice("pin_allocator", self.pin_allocator, PIN_ALLOCATORS,
                      "'caching' uses PyTorch's pinned allocator, 'exact' registers exact-size buffers "
                      "with cudaHostRegister (no power-of-two rounding)")
        pct = self.virtual_memory_safe_pct
        if pct is not None:
            if isinstance(pct, bool) or not isinstance(pct, (int, float)):
                _fail("virtual_memory_safe_pct", pct, "a number (percent) in (0, 100] or None",
                      "Pass e.g. 90 or 90.0, or None to turn the RAM ceiling off.", TypeError)
            if not 0 < pct <= 100:
                _fail("virtual_memory_safe_pct", pct, "a percentage in (0, 100] or None",
                      "None turns the RAM ceiling off.")
        object.__setattr__(self, "device", _normalise_device(self.device))

    # -- conversions -------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of every setting, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "OffloadConfig":
        """A config from a mapping of setting names; unknown names are an error (typos must not pass)."""
        if not isinstance(d, Mapping):
            raise TypeError(f"OffloadConfig.from_dict: expected a mapping of settings, got {type(d).__name__}.")
        valid = cls.field_names()
        unknown = sorted(str(k) for k in d if k not in valid)
        if unknown:
            raise ValueError(
                f"OffloadConfig.from_dict: unknown setting(s) {unknown}; valid settings are {list(valid)}."
            )
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """Every setting as plain Python values (what ``from_dict`` reads back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_yaml(cls, text: str) -> "OffloadConfig":
        """A config from yaml text: a mapping of settings (``from_yaml(path.read_text())`` for a file)."""
        import yaml

        data = yaml.safe_load(text)
        return cls.from_dict({} if data is None else data)

    def to_yaml(self) -> str:
        """Every setting as yaml text (``from_yaml`` reads it back to an equal config)."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes: Any) -> "OffloadConfig":
        """A copy with some settings changed (validated again)."""
        return dataclasses.replace(self, **changes)
