"""Every example, run as its runbook says from a fresh clone, writes nothing into the checkout (not even
a gitignored file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each example with its smallest arguments and no --out: the default output place is what is checked.
EXAMPLES = {
    "offload_loop.py": ["--steps", "1", "--dim", "32", "--seq", "16"],
    "offload_vs_checkpointing.py": ["--dim", "32", "--layers", "1", "--seq", "16", "--steps", "1"],
    "profile_offload_head.py": ["--dim", "32", "--layers", "1", "--seq", "16", "--steps", "2"],
    "hf_trainer.py": ["--steps", "1", "--seq", "16"],
    "lightning_trainer.py": ["--steps", "1", "--seq", "16"],
    "torchtitan_style.py": [],
    "torchrun_fsdp2.py": ["--steps", "1", "--dim", "32", "--seq", "16"],
}
NEEDS = {"hf_trainer.py": "transformers", "lightning_trainer.py": "lightning"}


def _status(clone: Path) -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=clone,
                          capture_output=True, text=True, check=True).stdout


def test_every_example_is_listed():
    """A new example is added to EXAMPLES (so it is checked too)."""
    assert set(EXAMPLES) == {p.name for p in (ROOT / "examples").glob("*.py")}


@pytest.mark.parametrize("script", list(EXAMPLES))
def test_example_leaves_the_checkout_untouched(clone, script):
    """`python examples/<script>` from the clone's root: `git status --porcelain --ignored` is unchanged."""
    if script in NEEDS:
        pytest.importorskip(NEEDS[script])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "PYTHONPATH")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1")
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    before = _status(clone)
    proc = subprocess.run([sys.executable, str(clone / "examples" / script), *EXAMPLES[script]], cwd=clone,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert _status(clone) == before, f"{script} wrote into the checkout:\n{_status(clone)}"


TORCH_OWN = ("torchinductor_", "torchelastic_")
"""What torch itself leaves in the temporary folder (its compile cache, the launcher's logs), not the
examples' files."""


@pytest.mark.parametrize("script", ["torchrun_fsdp2.py", "profile_offload_head.py"])
def test_example_leaves_no_temporary_files(tmp_path, script):
    """Run with its defaults (no --out), an example writes its artifacts into a temporary folder of its own
    and removes it: the temporary folder (TMPDIR) holds nothing of the example's afterwards, so no fixed
    path is shared by concurrent runs and nothing piles up."""
    tmp, cwd = tmp_path / "tmp", tmp_path / "cwd"
    tmp.mkdir()
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env.update(TMPDIR=str(tmp), CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1")
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *EXAMPLES[script]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    left = sorted(p.name for p in tmp.iterdir() if not p.name.startswith(TORCH_OWN))
    assert left == [], f"{script} left {left} in the temporary folder"
    assert "--out DIR" in proc.stdout, proc.stdout[-2000:]  # it says how to keep them
