"""Each bench-owned example runs on CPU, unchanged, in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, gpu: bool = False) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


GPU = pytest.param(True, marks=pytest.mark.gpu, id="gpu")


@pytest.mark.parametrize("gpu", [False, GPU], ids=["cpu", "gpu"])
def test_offload_loop_example_runs(gpu):
    """(a) trains a few steps under OffloadActivations and prints the ledger and pool."""
    out = _run("offload_loop.py", "--steps", "3", "--dim", "64", "--seq", "32", gpu=gpu)
    assert out.count("step ") == 3 and "offloaded" in out and "host pool" in out


@pytest.mark.parametrize("gpu", [False, GPU], ids=["cpu", "gpu"])
def test_offload_vs_checkpointing_example_runs(gpu):
    """(b) prints all four ways with gradients equal to `none`."""
    out = _run("offload_vs_checkpointing.py", "--dim", "64", "--layers", "2", "--seq", "32", "--steps", "1", gpu=gpu)
    rows = [line for line in out.splitlines()[1:] if line.strip()]
    assert [r.split()[0] for r in rows] == ["none", "ac", "offload", "offload+ac"]
    assert all(r.rstrip().endswith("True") for r in rows[1:]), out


@pytest.mark.parametrize("args", [["--list"], ["--strategies", "none,offload", "--steps", "1", "--warmup", "0",
                                               "--dim", "64", "--layers", "1", "--seq", "16", "--vocab", "64",
                                               "--quiet", "--no-write", "--no-probe"]])
def test_python_m_bench_runs(args):
    """`python -m bench` works as a module from the repo root."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "offload" in proc.stdout
