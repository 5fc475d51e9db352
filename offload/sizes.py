"""How a user writes an amount of memory: one parser for every size and budget, on every surface.

NOTE [ Sizes ]
Every setting in bytes (``OffloadConfig``'s ``Bytes`` fields, so the engine's keywords, ``from_dict``,
``from_yaml``, a torchtitan section, the callbacks' keywords and ``plan``'s ``engine_kwargs``), and
``plan``'s and the callbacks' budgets, go through :func:`to_bytes`, so one value means one number of
bytes wherever it is given, and every refusal says the same thing:

1. An int is bytes. A float is bytes when it holds a whole number (``2e9``, ``1.5e9``; ``1.5`` is
   refused, not rounded).
2. A string is a number with an optional unit, read exactly (decimal arithmetic, so ``"4.1GB"`` is
   4_100_000_000, never a binary float just below it): ``"2e9"``, ``"16GiB"``, ``"512 MB"``. Strings
   arrive from yaml (PyYAML reads ``2e9`` as a string), the environment and command lines, so a
   number without a unit is bytes there too.
3. Units, in any letter case: ``B``; ``KB MB GB TB`` are powers of 1000 (the SI prefixes, as disk
   and network sizes are written); ``KiB MiB GiB TiB`` are powers of 1024 (as memory is). A bare
   ``K M G T`` (``"16G"``) is refused, naming both readings: tools disagree on it (``free -g`` and
   Java's ``-Xmx16g`` mean 2**30, Kubernetes' ``16G`` means 10**9), and a budget must not be read
   7% away from what was meant. Kubernetes' ``"16Gi"`` is refused too, asking for ``"16GiB"``.
4. A budget (``plan(budget_bytes=)``, the callbacks' ``budget_bytes``/``budget``) may instead be a
   share of the device's memory: a string ``"N%"`` or a float in (0, 1] (``0.8``). ``1.0`` is
   100%, ``1`` is one byte.
5. Every size lies in [the setting's minimum, ``SIZE_LIMIT``].
"""

from __future__ import annotations

import decimal
import numbers
import re
from decimal import Decimal
from typing import Any, Union

__all__ = ["Bytes", "SIZE_FORMS", "SIZE_LIMIT", "SHARE_FORMS", "SizeLike", "to_bytes", "to_budget"]

Bytes = int
"""Annotation of a setting in bytes (``OffloadConfig`` parses every field annotated with it)."""
SizeLike = Union[int, float, str]
"""What a user may pass for a size (rule 1-3 of NOTE [ Sizes ])."""

SIZE_LIMIT = (1 << 63) - 1
"""The largest value of every size and count setting: a signed 64-bit size, what torch's sizes,
the C++ pack hook (int64) and a Python container's length (Py_ssize_t) hold. Any larger value
means the same as this one to the engine (nothing is that big), so it is refused, not clamped."""

SIZE_FORMS = ("an int of bytes (2000000000), a float holding a whole number (2e9, 1.5e9), or a string: "
              "a number with an optional unit ('2e9', '16GiB', '4.1GB', '512 MB'; B, KB MB GB TB = powers "
              "of 1000, KiB MiB GiB TiB = powers of 1024)")
"""The accepted forms, as every size error lists them."""
SHARE_FORMS = "a share of the device's memory ('80%' or a float in (0, 1] such as 0.8)"

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AMBIGUOUS = {"k": 1, "m": 2, "g": 3, "t": 4}
_TEXT = re.compile(r"\s*([+-]?(?:\d[\d_]*)?(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


class _Refused(Exception):
    """A value that is no size: the reason, and the exception type the caller raises."""

    def __init__(self, problem: str, exc: type[Exception] = ValueError) -> None:
        super().__init__(problem)
        self.exc = exc


def _exact(number: str | float | int, unit: int = 1) -> Decimal:
    """``number * unit`` exactly; _Refused if it cannot be held exactly (more digits than any size)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        ctx.traps[decimal.Inexact] = True
        try:
            value = (Decimal(number) if not isinstance(number, float) else Decimal(repr(number))) * unit
        except decimal.Inexact:
            raise _Refused("more digits than any size has") from None
    if not value.is_finite():
        raise _Refused("not a finite number")
    return value


def _from_text(text: str) -> Decimal:
    m = _TEXT.fullmatch(text)
    if m is None or not m.group(1).strip("+-.") or m.group(1).strip("+-")[:1] in ("e", "E"):
        raise _Refused("not a number with an optional unit")
    number, unit = m.group(1), m.group(2)
    if not unit:
        return _exact(number)
    if unit.lower() in _UNITS:
        return _exact(number, _UNITS[unit.lower()])
    prefix, binary = unit[:1].lower(), unit[1:].lower() == "i"
    if prefix in _AMBIGUOUS and (len(unit) == 1 or binary):
        n, u = _AMBIGUOUS[prefix], prefix.upper()
        if binary:  # Kubernetes' "16Gi": one reading, but written with its B
            raise _Refused(f"{unit!r} is not a unit: write '{number}{u}iB' ({u}iB = 2**{10 * n} bytes)")
        raise _Refused(f"the unit {unit!r} is ambiguous: write '{number}{u}B' ({u}B = 10**{3 * n} bytes) or "
                       f"'{number}{u}iB' ({u}iB = 2**{10 * n} bytes)")
    raise _Refused(f"{unit!r} is not a unit")


def _amount(value: Any) -> Decimal:
    """The number of bytes ``value`` says, exactly (rules 1-3), or _Refused."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str, Decimal)):
        raise _Refused(f"a {type(value).__name__} is not a size", TypeError)
    if isinstance(value, str):
        return _from_text(value)
    if isinstance(value, numbers.Integral):
        return Decimal(int(value))
    if isinstance(value, float) and value.is_integer():
        return Decimal(int(value))  # 2e9: the float's own value, exact
    return _exact(value if isinstance(value, (Decimal, float)) else float(value))


def _whole(nbytes: Decimal, minimum: int) -> int:
    if nbytes != nbytes.to_integral_value():
        raise _Refused(f"{nbytes.normalize():f} is not a whole number of bytes")
    if nbytes < minimum:
        raise _Refused(f"a size must be >= {minimum}")
    if nbytes > SIZE_LIMIT:
        raise _Refused(f"a size must be <= {SIZE_LIMIT} (2**63 - 1: the engine holds sizes as 64-bit "
                       "integers; any value that large already means 'no limit' in practice)")
    return int(nbytes)


def _message(owner: str, name: str, value: Any, problem: str, why: str, also: str = "") -> str:
    return (f"{owner}: {name}={value!r} is invalid: {problem}{f' ({why})' if why else ''}. "
            f"A size is {SIZE_FORMS}{also}.")


def to_bytes(value: Any, name: str, *, owner: str = "OffloadConfig", minimum: int = 0,
             allow_none: bool = False, why: str = "") -> int | None:
    """``value`` as an int number of bytes (NOTE [ Sizes ]), or None where ``allow_none``.

    Raises TypeError (a type that is never a size) or ValueError (any other refusal), both naming
    ``owner``, ``name`` and ``value``, the problem, ``why`` (what the setting means) and the forms.
    """
    if value is None and allow_none:
        return None
    try:
        if value is None:
            raise _Refused("None is not a size here", TypeError)
        return _whole(_amount(value), minimum)
    except _Refused as e:
        raise e.exc(_message(owner, name, value, str(e), why, " or None" if allow_none else "")) from None


def to_budget(value: Any, name: str, *, owner: str, shares_only: bool = False) -> int | Decimal:
    """A budget: an int of bytes (>= 1), or a Decimal share in (0, 1] for ``"N%"`` or a float <= 1
    (rule 4 of NOTE [ Sizes ]); ``shares_only``: refuse sizes."""
    try:
        if isinstance(value, str) and value.strip().endswith("%"):
            share = _from_text(value.strip()[:-1]) / 100
        elif isinstance(value, float) and value <= 1 or shares_only:
            if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
                raise _Refused(f"a {type(value).__name__} is not a share", TypeError)
            share = _amount(value)
        else:
            return _whole(_amount(value), 1)
        if not 0 < share <= 1:
            raise _Refused(f"a share must be in (0, 1] (0% < share <= 100%), got {share.normalize():f}")
        return share
    except _Refused as e:
        if shares_only:
            raise e.exc(f"{owner}: {name}={value!r} is invalid: {e}. Pass {SHARE_FORMS}.") from None
        raise e.exc(_message(owner, name, value, str(e), "", f"; or {SHARE_FORMS}")) from None
