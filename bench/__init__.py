"""The side-by-side bench (``python -m bench``) and its tools: repo tools, run from a checkout, not in the wheel.

``bench.model`` (the toy Llama the examples share) needs the core install only; the runs need the
``bench`` extra of pyproject.toml (numpy, scipy, matplotlib): ``pip install -e ".[bench]"``. Any bench
command (``python -m bench``, ``python -m bench.probe``, ...) run without it prints one line naming the
extra and exits 1, wherever the missing module is first imported (``_excepthook``).
"""

from __future__ import annotations

import sys
from types import TracebackType

EXTRA = "bench"
"""The extra (pyproject.toml) that installs what the bench's runs import beyond the core install."""

EXTRA_MODULES = ("numpy", "scipy", "matplotlib")
"""The top-level modules the extra installs (tests/bench check them against pyproject.toml)."""


class MissingBenchExtra(ModuleNotFoundError):
    """A module the bench needs is not installed; the message names the extra that installs it."""

    def __init__(self, module: str) -> None:
        super().__init__(f"the bench needs {module}, which is not installed: install the `{EXTRA}` extra, "
                         f'pip install -e ".[{EXTRA}]" (from the checkout; `.[test]` includes it)', name=module)


def _missing_extra(exc: BaseException) -> MissingBenchExtra | None:
    """``exc`` as the bench extra's missing module, or None when it is something else."""
    if isinstance(exc, MissingBenchExtra):
        return exc
    top = (getattr(exc, "name", None) or "").partition(".")[0]
    return MissingBenchExtra(top) if isinstance(exc, ModuleNotFoundError) and top in EXTRA_MODULES else None


def _prog() -> str:
    """How the running bench command was started (``python -m bench.probe``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return f"python -m {name.removesuffix('.__main__')}" if name.startswith("bench") else "bench"


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None,
                previous=sys.excepthook) -> None:
    """An uncaught missing module of the extra: one line naming the extra (Python then exits 1), not a
    traceback that ends in "No module named numpy"; anything else goes to the hook that was there."""
    missing = _missing_extra(exc)
    if missing is None:
        previous(kind, exc, tb)
        return
    print(f"{_prog()}: {missing}", file=sys.stderr)


if getattr(sys.excepthook, "__module__", None) != __name__:
    sys.excepthook = _excepthook
