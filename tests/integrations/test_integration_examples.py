"""The integration examples run on CPU, unchanged, in a fresh interpreter, and print the ledger's figures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _steps(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("step ")]


def test_torchtitan_style_example_offloads_without_changing_the_loss():
    """The torchtitan-style loop offloads under mode=full and prints the same losses as mode=none."""
    full, none = _steps(_run("torchtitan_style.py")), _steps(_run("torchtitan_style.py", "--mode", "none"))
    assert len(full) == len(none) == 3
    assert all("offloaded" in line for line in full)
    assert [line.split("offloaded")[0].strip() for line in full] == [line.strip() for line in none]


def test_hf_trainer_example_runs():
    """examples/hf_trainer.py trains 2 steps with OffloadCallback and prints offloaded bytes per step."""
    pytest.importorskip("transformers")
    lines = _steps(_run("hf_trainer.py", "--steps", "2", "--seq", "32"))
    assert len(lines) == 2 and all("offloaded" in line for line in lines)


def test_lightning_trainer_example_runs():
    """examples/lightning_trainer.py trains 2 steps with OffloadCallback and prints offloaded bytes per step."""
    pytest.importorskip("lightning")
    lines = _steps(_run("lightning_trainer.py", "--steps", "2", "--seq", "32"))
    assert len(lines) == 2 and all("offloaded" in line for line in lines)
