"""Where the bench runs: device choice, the results folder name, run metadata."""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["default_device", "device_name", "device_slug", "results_dir", "default_run_dir", "run_metadata",
           "REPO_ROOT"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def default_device() -> str:
    """``"cuda"`` when a CUDA GPU is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(device: str | torch.device) -> str:
    """Human name: ``"cpu"`` or e.g. ``"NVIDIA H100 80GB HBM3"``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"


def device_slug(device: str | torch.device | None = None) -> str:
    """Folder name under ``bench/results``: ``"cpu"`` or e.g. ``"nvidia-h100-80gb-hbm3"``."""
    name = device_name(device if device is not None else default_device())
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def results_dir(device: str | torch.device | None = None) -> Path:
    """``bench/results/<device-slug>`` in the checkout: where the files the README cites live.

    Only written when asked for explicitly (``--out bench/results/cpu``); the default is
    :func:`default_run_dir`, so a plain run never modifies tracked files.
    """
    return REPO_ROOT / "bench" / "results" / device_slug(device)


RUNS_DIRNAME = "bench_runs"
"""Default output root, created in the current directory (``/bench_runs/`` is gitignored)."""


def default_run_dir(tool: str, name: str, *, now: datetime.datetime | None = None) -> Path:
    """A fresh run folder ``./bench_runs/<UTC time>_<tool>_<name>/`` under the current directory.

    Outside the package (never into a checkout's tracked files or site-packages); one folder
    per run, so runs never overwrite each other.
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    stem = f"{now.strftime('%Y%m%dT%H%M%SZ')}_{tool}_{name}"
    path = Path.cwd() / RUNS_DIRNAME / stem
    n = 1
    while path.exists():  # two runs in the same second
        n += 1
        path = Path.cwd() / RUNS_DIRNAME / f"{stem}_{n}"
    return path


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=5, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _loadavg() -> float | None:
    """1-minute load average (a shared machine's timings are only as good as its load)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def run_metadata(device: str | torch.device, argv: list[str] | None = None) -> dict[str, Any]:
    """What a results file needs to be reproduced: versions, device, threads, command, commit, time."""
    dev = torch.device(device)
    meta: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(dev),
        "device_name": device_name(dev),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "loadavg_1m_at_start": _loadavg(),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        meta["device_total_memory_bytes"] = props.total_memory
        meta["cuda"] = torch.version.cuda
    return meta
