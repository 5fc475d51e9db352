"""The side-by-side bench (``python -m bench``) and its tools: repo tools, run from a checkout, not in the wheel.

``bench.model`` (the toy Llama the examples share) needs the core install only; the runs need the
``bench`` extra of pyproject.toml (numpy, scipy, matplotlib): ``pip install -e ".[bench]"``.
"""

from __future__ import annotations

EXTRA = "bench"
"""The extra (pyproject.toml) that installs what the bench's runs import beyond the core install."""


class MissingBenchExtra(ModuleNotFoundError):
    """A module the bench needs is not installed; the message names the extra that installs it."""

    def __init__(self, module: str) -> None:
        super().__init__(f"the bench needs {module}, which is not installed: install the `{EXTRA}` extra, "
                         f'pip install -e ".[{EXTRA}]" (from the checkout; `.[test]` includes it)', name=module)
