"""README.md stays true: every Python block runs as written, and the lists it gives match the code.

Convention: every ```python block is executed on CPU in a fresh interpreter (cwd: a temporary
folder, the repo on PYTHONPATH). A block that cannot run on a CPU in a few seconds (it needs a GPU,
a dataset, a long trainer run) starts with the line ``# not run: <reason>`` and is only compiled.
Shell commands go in ```bash blocks, which are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import offload

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NOT_RUN = re.compile(r"#\s*not run:\s*(\S.*)")


def _python_blocks() -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block."""
    blocks, lines = [], README.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 2, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = _python_blocks()


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_python_block_runs(line, code, tmp_path):
    """The block runs as written on CPU (or, marked ``# not run: <reason>``, at least compiles)."""
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    compile(code, f"README.md:{line}", "exec")  # every block must at least be valid Python
    if NOT_RUN.match(first):
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="default")
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, (
        f"README.md block at line {line} failed (mark it '# not run: <reason>' only if it cannot run on "
        f"a CPU in seconds):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def test_not_run_blocks_give_a_reason():
    """A skipped block says why (``# not run:`` followed by text)."""
    for line, code in BLOCKS:
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        if first.lstrip().startswith("# not run"):
            assert NOT_RUN.match(first), f"README.md:{line}: '# not run:' needs a reason"


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([a-z_]+)`", text)


def test_readme_lists_exactly_the_reasons():
    """The API table's REASONS row and the glossary list every reason in offload.REASONS, in order."""
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `REASONS` |"))
    assert tuple(_backticked(row.split("|")[2])) == offload.REASONS
    glossary = text.split("## Glossary", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^  - `([a-z_]+)`:", glossary, flags=re.M)
    assert tuple(listed) == offload.REASONS


def test_readme_cites_results_files_that_exist():
    """Every bench/results/... file the README cites is in the repo."""
    cited = set(re.findall(r"`(bench/results/[\w./-]+\.(?:json|md|png))`", README.read_text()))
    assert cited, "the README cites no results file"
    missing = sorted(p for p in cited if not (ROOT / p).is_file())
    assert not missing, missing
