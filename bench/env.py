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
           "environment_record", "gpu_trace_state", "cpu_record", "REPO_ROOT", "COMMIT_ENV"]

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


COMMIT_ENV = "OFFLOAD_GIT_COMMIT"
"""The commit a results file records when the tree has no ``.git`` (the GPU machine gets a copy of the
working tree without one): ``scripts/gpu_run.sh --commit SHA`` exports it."""


def _git_commit() -> str | None:
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
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


def gpu_trace_state() -> dict[str, Any]:
    """The Python callbacks registered in torch's GPU trace (``torch.cuda._gpu_trace``), which fire on every CUDA
    caching-allocator allocation and free, event record and wait, and synchronization of the process while the
    trace is active: ``callbacks`` (their number; 0 is the only clean value for a timing), the non-empty
    registries by name, and whether ``torch.cuda._sanitizer`` (which registers ten of them when imported) is
    loaded. Every GPU timing before issue 40's fix was taken with ten of them registered."""
    import torch.cuda._gpu_trace as gpu_trace

    regs = {n: len(r.callback_list) for n in dir(gpu_trace) if hasattr(r := getattr(gpu_trace, n), "callback_list")}
    return {"callbacks": sum(regs.values()), "registries": {n: k for n, k in regs.items() if k},
            "registries_checked": len(regs), "sanitizer_imported": "torch.cuda._sanitizer" in sys.modules}


def _cpu_mhz() -> list[float]:
    """Each logical CPU's current clock (MHz), from ``/proc/cpuinfo`` (Linux), else psutil's."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":", 1)[1]) for line in f if line.startswith("cpu MHz")]
        if mhz:
            return mhz
    except (OSError, ValueError):
        pass
    try:
        import psutil

        return [f.current for f in psutil.cpu_freq(percpu=True) or []]
    except Exception:  # psutil without cpu_freq on this platform
        return []


def cpu_record() -> dict[str, Any]:
    """The host CPU a timing depends on: model, logical and physical cores, clock now (min/median/max over the
    cores, MHz) and its limits, the frequency governor, and the load (1/5/15-minute averages). A host that
    is slower or busier than the last run's shows here, so a slower step can be told from a slower engine."""
    import statistics

    import psutil

    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    mhz = _cpu_mhz()
    freq = psutil.cpu_freq() if hasattr(psutil, "cpu_freq") else None
    governor = None
    try:
        governor = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").read_text().strip()
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    return {"model": model or platform.processor() or None, "logical_cores": os.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "mhz_now": {"min": min(mhz), "median": statistics.median(mhz), "max": max(mhz)} if mhz else None,
            "mhz_limits": {"min": freq.min, "max": freq.max} if freq is not None and freq.max else None,
            "governor": governor, "loadavg_1_5_15m": load}


def run_metadata(device: str | torch.device, argv: list[str] | None = None) -> dict[str, Any]:
    """What a results file needs to be reproduced: versions, device, threads, command, commit, time, the host
    CPU and the GPU-trace callbacks registered when the run started (``gpu_trace_state``)."""
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
        "cpu": cpu_record(),
        "gpu_trace_at_start": gpu_trace_state(),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        meta["device_total_memory_bytes"] = props.total_memory
        meta["cuda"] = torch.version.cuda
    return meta


_PACKAGES = ("torch", "numpy", "psutil", "transformers", "accelerate", "peft", "lightning", "trl", "pulp", "pwlf",
             "pytest", "pytest_timeout", "hypothesis", "tabulate", "tqdm", "matplotlib", "scipy", "ninja")


def _package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _nvidia_smi() -> str | None:
    query = "name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max,clocks.max.sm"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True,
                             text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout or out.stderr).strip() or None


IMPORTED_BY_THE_RUN = ("bench.cli", "bench.harness", "bench.plan", "bench.predicted_vs_measured", "offload.predict",
                       "offload.testing", "offload.planner")
"""What the GPU run's processes import: ``environment_record`` imports them before it counts the GPU-trace
callbacks, so the count is what the bench and the tests run with (issue 40: ``offload.testing`` used to
import ``torch.cuda._sanitizer``, whose ten callbacks were on in every timing taken before)."""


def environment_record() -> dict[str, Any]:
    """What a GPU run's results depend on, read once at its start (``scripts/gpu_run.sh`` phase env):
    versions, the device, the host CPU (model, clock, governor, load), host memory
    (``psutil.virtual_memory()``: a VM whose memory grows as used makes the engine's RAM gauge read high),
    the pinned-memory APIs this torch has, the settings in force, and the GPU-trace callbacks registered
    after importing what the run's processes import (``gpu_trace``: 0 callbacks for a clean timing)."""
    import importlib
    import resource
    import shutil

    import psutil

    cuda = torch.cuda.is_available()
    rec: dict[str, Any] = run_metadata("cuda" if cuda else "cpu", [])
    rec.pop("command", None)
    rec["commit_source"] = "env " + COMMIT_ENV if os.environ.get(COMMIT_ENV) else "git"
    rec["virtual_memory"] = psutil.virtual_memory()._asdict()
    rec["swap_memory"] = psutil.swap_memory()._asdict()
    rec["memlock_rlimit"] = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    rec["packages"] = _package_versions()
    rec["torch_cuda"] = torch.version.cuda
    rec["cudnn"] = torch.backends.cudnn.version() if cuda else None
    rec["host_cache_api"] = {
        "torch.accelerator.empty_host_cache": hasattr(getattr(torch, "accelerator", None), "empty_host_cache"),
        "torch._C._host_emptyCache": hasattr(torch._C, "_host_emptyCache"),
    }
    rec["env"] = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "PYTORCH_CUDA_ALLOC_CONF",
                                                  "PYTORCH_ALLOC_CONF", "TORCH_CUDA_SANITIZER", "CUDA_VISIBLE_DEVICES")}
    rec["compilers"] = {n: shutil.which(n) for n in ("g++", "ninja", "nvcc")}
    rec["nvidia_smi"] = _nvidia_smi()
    if cuda:
        p = torch.cuda.get_device_properties(0)
        rec["device_properties"] = {"name": p.name, "total_memory": p.total_memory, "capability": [p.major, p.minor],
                                    "multi_processor_count": p.multi_processor_count}
    failed = {}
    for name in IMPORTED_BY_THE_RUN:
        try:
            importlib.import_module(name)
        except Exception as e:  # recorded, not fatal: the count is still read
            failed[name] = f"{type(e).__name__}: {e}"
    rec["gpu_trace"] = {**gpu_trace_state(), "after_importing": list(IMPORTED_BY_THE_RUN), "import_errors": failed}
    return rec


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.env --out env.json``: write :func:`environment_record` as JSON (and print it)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m bench.env", description=environment_record.__doc__)
    p.add_argument("--out", type=Path, default=None, help="JSON file to write (default: print only)")
    args = p.parse_args(argv)
    text = json.dumps(environment_record(), indent=1, default=str) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
