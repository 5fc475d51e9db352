"""OffloadConfig: every engine setting in one frozen, validated, serialisable object.

``OffloadActivations(**kwargs)`` builds one of these from its arguments, so
the checks below are the only place a setting is validated, whichever way
it arrives (arguments, ``config=``, a dict or a yaml file from a trainer's
config). Each error names the setting, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .pool import PIN_ALLOCATORS
from .sizes import SIZE_LIMIT, Bytes, to_bytes

__all__ = ["OffloadConfig", "SIZE_FIELDS", "SIZE_LIMIT", "resolve_device", "settled_config", "size_setting"]

ON_HOST_BUDGET = ("keep", "pageable", "raise")
_MiB = 1 << 20


_OWN = "OffloadConfig: "
"""How every OffloadConfig validation error starts (``settled_config`` names the engine instead)."""


def _fail(name: str, value: Any, expected: str, fix: str = "", exc: type[Exception] = ValueError) -> None:
    raise exc(
        f"{_OWN}{name}={value!r} is invalid: expected {expected}"
        f" (got {type(value).__name__}).{' ' + fix if fix else ''}"
    )


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        fix = "Pass a bool, not a string or a number."
        if name in ("use_pin_memory", "use_streams") and _is_device(value):  # OffloadActivations("cpu"): the first positional argument is use_pin_memory
            fix = (f"{value!r} is a device: pass it by name, device={str(value)!r} (the positional arguments "
                   "are use_pin_memory and use_streams, as in torchtune).")
        _fail(name, value, "True or False", fix, TypeError)


def _is_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return True
    try:
        return isinstance(value, str) and torch.device(value) is not None
    except (RuntimeError, TypeError, ValueError):
        return False


def _check_int(name: str, value: Any, minimum: int, why: str, allow_none: bool = False) -> None:
    """An int count setting in [minimum, SIZE_LIMIT] (or None where allowed); sizes go to ``to_bytes``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, f"an int{' or None' if allow_none else ''} ({why})",
              "Pass a whole number (e.g. 1024, not '1024').", TypeError)
    if value < minimum:
        _fail(name, value, f"an int >= {minimum}{' or None' if allow_none else ''} ({why})")
    if value > SIZE_LIMIT:
        _fail(name, value, f"an int <= {SIZE_LIMIT} (2**63 - 1: {why}; the engine holds sizes and counts "
                           "as 64-bit integers)",
              "Pass a smaller value: any value that large already means 'no limit' in practice"
              + (", and None means no limit." if allow_none else "."))


def unknown_names_message(unknown: list[str], valid: tuple[str, ...] | list[str]) -> str:
    """``'x' (did you mean 'y'?)`` for each unknown name, the closest valid one by ``difflib``."""
    parts = []
    for name in unknown:
        longer = sorted((v for v in valid if v.startswith(str(name))), key=len)  # host_budget -> host_budget_bytes
        close = longer[:1] or difflib.get_close_matches(str(name), list(valid), n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(parts)


def check_keywords(owner: str, valid: tuple[str, ...] | list[str], given: Mapping[str, Any]) -> None:
    """TypeError naming each keyword not in ``valid`` with the closest valid one (a typo is never
    Python's bare "unexpected keyword argument", nor blamed on another class's ``__init__``)."""
    unknown = [k for k in given if k not in valid]
    if unknown:
        raise TypeError(f"{owner}: unknown keyword argument(s) {unknown_names_message(unknown, valid)}; "
                        f"valid ones are {list(valid)}.")


def keywords_checked(init: Any) -> Any:
    """Wrap an ``__init__`` so an unknown keyword raises ``check_keywords``' error, naming the class.

    The wrapper shares ``init``'s keyword defaults (``__kwdefaults__`` is the same dict), so code that
    changes a default on the class's ``__init__`` changes it for the real one.
    """
    names = tuple(p.name for p in inspect.signature(init).parameters.values()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self")

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        check_keywords(type(self).__name__, names, kwargs)
        init(self, *args, **kwargs)

    __init__.__kwdefaults__ = init.__kwdefaults__
    return __init__


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


def _normalise_disk_dir(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        _fail("disk_dir", value, "None or a directory path (str or os.PathLike)",
              "None turns the disk tier off.", TypeError)
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        _fail("disk_dir", value, "a non-empty directory path", "None turns the disk tier off.")
    if os.path.exists(path) and not os.path.isdir(path):
        _fail("disk_dir", value, "a directory (it exists as a file)",
              "Pass a directory: the engine makes its own run directory in it, and creates it if missing.")
    return path


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
    max_fwd_stash_size: int | None = None
    """Optional cap on tensors whose device-to-host copy is in flight (sources alive); None = no cap (waits cost speed)."""
    min_offload_size: Bytes = 1024
    """Tensors with fewer bytes than this stay on the device."""
    device: str | None = None
    """Device whose saved tensors are offloaded: None = current accelerator, "cpu" = CPU tensors."""
    max_inflight_bytes: Bytes | None = None
    """Optional cap on bytes of in-flight device-to-host copies (sources alive); None = no cap."""
    device_budget_bytes: Bytes | None = None
    """Device bytes the step stays within (compute waits on copies only for it); None = all off by forward's end."""
    prefetch_bytes: Bytes | None = None
    """Cap on bytes backward loads ahead of need; None = as far as the device's headroom allows, 0 = off."""
    host_budget_bytes: Bytes | None = None
    """Cap on host pool bytes (pinned where possible; the first tier); None = no fixed cap."""
    pageable_budget_bytes: Bytes | None = 0
    """Second tier, pageable host memory: 0 = none, a size = its cap in bytes, None = the RAM ceiling only."""
    disk_dir: str | None = None
    """Third tier: directory for the disk tier's run directory (created if missing); None = no disk tier."""
    disk_budget_bytes: Bytes | None = None
    """Cap on the disk tier's file bytes (used only with disk_dir); None = the free space less min(1 GiB, 5% of it)."""
    disk_queue_bytes: Bytes = 256 * _MiB
    """Bound on host bytes staged for the disk tier's writer threads (a pack waits beyond it)."""
    disk_readahead_bytes: Bytes = 256 * _MiB
    """Bytes of disk-tier files backward reads ahead of need (on a reader thread)."""
    on_host_budget: str = "keep"
    """What a tensor that fits no tier gets: "keep" (on device) or "raise"; "pageable" = pageable_budget_bytes=None, then keep."""
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
    native_hooks: bool | str = "auto"
    """Pack hook in C++ (keep path; offload decision and records): "auto" where it builds, True: now or raise."""
    verify: bool = False
    """Checksum offloaded bytes at pack and check them when backward reads them (debugging; one sync per reload)."""

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            object.__setattr__(self, name, size_setting(name, getattr(self, name)))
        for name in ("use_pin_memory", "use_streams", "dedupe", "timing", "verify"):
            _check_bool(name, getattr(self, name))
        if not isinstance(self.native_hooks, bool) and self.native_hooks != "auto":
            _fail("native_hooks", self.native_hooks, "'auto', True or False",
                  "'auto' (the default) uses the C++ pack hook wherever it builds, True requires it, False never "
                  "uses it.", TypeError)
        _check_int("max_fwd_stash_size", self.max_fwd_stash_size, 1,
                   "it caps how many tensors may have a device-to-host copy in flight; None = no cap",
                   allow_none=True)
        _check_int("max_records", self.max_records, 0, "a count of records")
        object.__setattr__(self, "disk_dir", _normalise_disk_dir(self.disk_dir))
        _check_choice("on_host_budget", self.on_host_budget, ON_HOST_BUDGET,
                      "keep the tensor on the device or raise OffloadError ('pageable' = "
                      "pageable_budget_bytes=None, then keep)")
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
                f"OffloadConfig.from_dict: unknown setting(s) {unknown_names_message(unknown, valid)}; "
                f"valid settings are {list(valid)}."
            )
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """Every setting as plain Python values (what ``from_dict`` reads back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_yaml(cls, text: str) -> "OffloadConfig":
        """A config from yaml text: a mapping of settings (``from_yaml(path.read_text())`` for a file)."""
        data = _yaml_load(text)
        return cls.from_dict({} if data is None else data)

    def to_yaml(self) -> str:
        """Every setting as yaml text (``from_yaml`` reads it back to an equal config)."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes: Any) -> "OffloadConfig":
        """A copy with some settings changed (validated again)."""
        return dataclasses.replace(self, **changes)


OffloadConfig.__init__ = keywords_checked(OffloadConfig.__init__)  # type: ignore[method-assign]

SIZE_FIELDS = tuple(f.name for f in dataclasses.fields(OffloadConfig) if str(f.type).startswith("Bytes"))
"""Settings in bytes (annotated ``Bytes``): each takes every form of NOTE [ Sizes ] in offload/sizes.py."""
_NONE_SIZES = frozenset(f.name for f in dataclasses.fields(OffloadConfig) if str(f.type) == "Bytes | None")
_SIZE_RANGE = {
    "max_inflight_bytes": (1, "it caps the bytes of device-to-host copies in flight; None = no cap"),
    "device_budget_bytes": (1, "the device bytes the step stays within; None = every offloaded byte off the "
                               "device by the forward's end"),
    "prefetch_bytes": (0, "a size in bytes; 0 turns prefetch off, None sizes it from the copies"),
    "host_budget_bytes": (0, "a size in bytes; None = no fixed cap"),
    "pageable_budget_bytes": (0, "a size in bytes; 0 = no pageable tier, None = bounded by the RAM ceiling only"),
    "disk_budget_bytes": (0, "a size in bytes; None = the free space less a margin"),
    "disk_queue_bytes": (1, "it bounds the bytes staged for the disk tier's writers"),
    "disk_readahead_bytes": (0, "a size in bytes; 0 = no read-ahead"),
}
"""Each size setting's minimum and meaning, for its errors (default: >= 0, "a size in bytes")."""


def size_setting(name: str, value: Any, *, owner: str = "OffloadConfig", label: str | None = None) -> int | None:
    """The size setting ``name`` (one of ``SIZE_FIELDS``) in bytes, with its own minimum and None rule;
    errors name ``owner`` and ``label`` (default ``name``)."""
    minimum, why = _SIZE_RANGE.get(name, (0, "a size in bytes"))
    return to_bytes(value, label or name, owner=owner, minimum=minimum, why=why, allow_none=name in _NONE_SIZES)


def _yaml_load(text: str) -> Any:
    """``yaml.safe_load`` reading ``2e9`` as a float, as YAML 1.2 does (PyYAML's 1.1 rules need a dot,
    so ``host_budget_bytes: 2e9`` would otherwise arrive as the string '2e9')."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\d[\d_]*(?:\.[\d_]*)?[eE][-+]?\d+)$"),
        list("-+0123456789"),
    )
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


# -- what the engine makes of its arguments -------------------------------------------


def resolve_device(device: Any) -> torch.device | None:
    """The device an engine's ``device`` setting names: None = the current accelerator (None when
    there is none: pass-through), else the parsed device, checked to exist on this machine."""
    if device is None:
        if not torch.accelerator.is_available():
            return None
        acc = torch.accelerator.current_accelerator()
        idx_fn = getattr(torch.accelerator, "current_device_index", None) or torch.accelerator.current_device_idx
        return torch.device(acc.type, idx_fn())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(
            f"OffloadActivations: device={device!r} is not a device ({e}). Pass None for the "
            "current accelerator, 'cpu' to offload CPU tensors into the host pool, or e.g. 'cuda:0'."
        ) from None
    if dev.type == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, dev.type, None)
    available = mod is not None and hasattr(mod, "is_available") and mod.is_available()
    if not available:
        raise ValueError(
            f"OffloadActivations: device={device!r} is not available on this machine "
            f"(torch.{dev.type}.is_available() is False). Pass None to use the current "
            "accelerator (pass-through when there is none) or 'cpu'."
        )
    idx = dev.index if dev.index is not None else mod.current_device()
    count = mod.device_count()
    if idx >= count:
        raise ValueError(
            f"OffloadActivations: device={device!r} does not exist: this machine has {count} "
            f"{dev.type} device(s) (indices 0..{count - 1})."
        )
    return torch.device(dev.type, idx)


def settled_config(settings: dict[str, Any], config: OffloadConfig | None,
                   owner: str = "OffloadActivations") -> OffloadConfig:
    """The engine's OffloadConfig: built from ``settings`` (validated there, each error naming ``owner``,
    what the user called, not the OffloadConfig built for it), or ``config`` when given, then with no
    setting also passed as an argument."""
    if config is None:
        try:
            return OffloadConfig(**settings)  # validates every setting (type and range)
        except (TypeError, ValueError) as e:
            msg = str(e)
            if not msg.startswith(_OWN):
                raise
            raise type(e)(f"{owner}: {msg[len(_OWN):]}") from None
    if not isinstance(config, OffloadConfig):
        raise TypeError(
            f"OffloadActivations: config={config!r} is not an OffloadConfig (got "
            f"{type(config).__name__}). Build one with OffloadConfig(...) or "
            "OffloadConfig.from_dict(d)."
        )
    defaults = OffloadConfig()
    both = sorted(k for k, v in settings.items() if v != getattr(defaults, k))
    if both:
        raise TypeError(
            f"OffloadActivations: {both} given both as argument(s) and through config=; "
            "pass each setting one way: config.replace(name=value) changes a config."
        )
    return config
