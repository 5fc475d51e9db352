"""``offload.profiling`` when offload runs from a source checkout.

The repository keeps the profilers in a top-level ``profiling/`` folder beside ``offload/`` (the
project's layout), but they install and import as ``offload.profiling``: a distribution named
``profiling`` exists on the package index, and a top-level ``profiling`` in our wheel would collide with
it. The wheel maps the folder there (``[tool.setuptools] package-dir`` in pyproject.toml), and so does an
editable install's finder; this finder does the same for a checkout that is only on ``sys.path``
(``PYTHONPATH=.``, pytest's ``pythonpath``), and makes ``offload.profiling`` always the folder beside
*this* ``offload/`` (a second worktree on the path of another's editable install included).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

NAME = "offload.profiling"


class _SiblingFinder(importlib.abc.MetaPathFinder):
    """Finds ``offload.profiling`` (the package only: its modules are found through its ``__path__``)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        return importlib.util.spec_from_file_location(
            NAME, os.path.join(self.folder, "__init__.py"), submodule_search_locations=[self.folder])


def install() -> None:
    """Register the finder when this ``offload/`` has no ``profiling/`` inside (a checkout, not a wheel)
    and its sibling ``profiling/`` folder is a package; a no-op otherwise, and when already registered."""
    here = os.path.dirname(os.path.abspath(__file__))
    sibling = os.path.join(os.path.dirname(here), "profiling")
    if os.path.isdir(os.path.join(here, "profiling")) or not os.path.isfile(os.path.join(sibling, "__init__.py")):
        return
    if not any(isinstance(f, _SiblingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SiblingFinder(sibling))
