"""Venvs for the tests that install the wheel and sdist (stdlib only: a test runs it from a venv's python too)."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path


def _site_dirs() -> list[str]:
    """The folders this interpreter imports installed packages from, in order: sys.path from its first
    site-packages on (its venv's, the base's if that venv sees them, the user's, and what their .pth files
    add, such as an outer environment's listed by this module)."""
    sites = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    first = min((sys.path.index(d) for d in sites if d in sys.path), default=len(sys.path))
    return [d for d in dict.fromkeys(sys.path[first:]) if d and os.path.isdir(d)]


def venv_on_this_environment(venv: Path) -> Path:
    """A fresh venv that sees the packages of the environment running the tests (torch, the dependencies,
    pip and the build tools; offline), behind its own; its python. `--system-site-packages` is not that
    inside a venv: it shows the *base* interpreter's packages, and a venv-installed psutil went missing.
    The paths are listed in a .pth file (their own .pth files, e.g. an editable offload, are not run)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    (site_packages(py) / "_outer_environment.pth").write_text("".join(d + "\n" for d in _site_dirs()))
    return py


def site_packages(py: Path) -> Path:
    """Where ``py`` installs pure-Python packages (its venv's site-packages)."""
    return Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
