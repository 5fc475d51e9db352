"""The integration examples run on CPU, unchanged, and print the ledger's figures.

They run in this interpreter (``main(argv)``), not in a subprocess: importing
torch, transformers and lightning again would cost most of the test's time.
"""

from __future__ import annotations

import contextlib
import io
import runpy
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the examples pick the GPU when there is one")


def _run(script: str, *args: str) -> str:
    main = runpy.run_path(str(ROOT / "examples" / script), run_name="example")["main"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(list(args))
    return out.getvalue()


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
