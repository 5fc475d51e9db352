"""The engine's backward on autograd's device thread, on CPU (the thread every GPU backward runs on).

On a CPU tensor backward runs on the caller's thread, so the unpack path (reloads, the stash,
prefetch, the in-place error raised from the hook) never left the main thread in CI, while on CUDA
it always runs on autograd's device thread. ``device_thread_child.py`` registers a CPU-backed
accelerator with a C++ device guard, so autograd gives it a device thread, and runs the scenarios in
a fresh interpreter (autograd counts devices once per process). Why it exists: on an H200 the two
in-place tests failed with "SystemError: run_backward returned NULL without setting an exception"
(``bench/results/nvidia-h200/2026-11-26-49b9263/gpu_tests.txt``); here the same bodies, on the device
thread, with in-flight copies, on torch 2.13/Python 3.11 and on torch 2.11/Python 3.12 (the GPU machine's),
raise the right error, so the cause is not the thread alone (``test_gpu_offload.py::
test_gpu_error_raised_in_an_unpack_hook_reaches_the_caller`` separates torch's path from ours on the
next GPU run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from device_thread_child import SCENARIOS

pytestmark = pytest.mark.device_thread

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("needs a C++ compiler to build the device-thread test device")
    if shutil.which("ninja") is None:
        pytest.skip("needs ninja (pip install ninja) to build the device-thread test device")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("device_thread_child.py"))],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["scenario"]] = r
    assert proc.returncode == 0 and out, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_on_the_device_thread(reports, scenario):
    r = reports.get(scenario)
    assert r is not None, f"{scenario} did not report (the child stopped before it): {sorted(reports)}"
    assert r["ok"], r["detail"]
