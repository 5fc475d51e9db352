"""Progress bars for the bench tools: one ``tqdm`` style, on stderr, so no phase runs silently.

On a terminal the bar redraws in place; in a log (stderr not a terminal) it prints a line at
most every 10 seconds, so a long phase still shows it is alive without flooding the log.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

__all__ = ["bar", "note"]


def bar(total: int | None, desc: str, *, enabled: bool = True, unit: str = "step", **kwargs: Any) -> tqdm:
    """A ``tqdm`` bar on stderr (``enabled=False``: a silent one with the same interface)."""
    tty = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, leave=True,
                dynamic_ncols=True, mininterval=0.2 if tty else 10.0, **kwargs)


def note(text: str, *, enabled: bool = True) -> None:
    """One line on stderr that does not break a running bar."""
    if enabled:
        tqdm.write(f"[bench] {text}", file=sys.stderr)
