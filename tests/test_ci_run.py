""".ci/run fails when any step fails. Its README commands are `&&` lists, and `set -e` does not stop at a
failure inside one (only at its last command), so a failing test pass used to be hidden by the steps
after it. Run here with stand-ins for pip, pytest and python on PATH: nothing is installed or run."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(sys.platform != "linux" or shutil.which("bash") is None,
                                reason=".ci/run is a bash script run on Linux")

_STANDINS = {
    # `pip install -e ".[bench]"` fails as told by FAIL_BENCH (a step inside the main job's && list).
    "pip": 'case "$*" in *"[bench]"*) [ -z "$FAIL_BENCH" ] || exit 9 ;; esac; exit 0',
    # A bare `pytest` may be another environment's (a --system-site-packages venv finds the system's first):
    # .ci/run, as the README, runs `python -m pytest` only (issue 45 item 7).
    "pytest": 'echo "bare pytest called: use python -m pytest" >&2; exit 99',
    # `python -m venv DIR` makes DIR/bin/activate; `python -m pytest` fails as told by FAIL_PYTEST, except for
    # the venv case's run (tests/test_packaging.py), which passes.
    "python": 'if [ "$1 $2" = "-m venv" ]; then d="${@: -1}"; mkdir -p "$d/bin"; : > "$d/bin/activate"; fi; '
              'if [ "$1 $2" = "-m pytest" ]; then case "$*" in *test_packaging.py*) exit 0 ;; esac; '
              '[ -z "$FAIL_PYTEST" ] || exit 7; fi; exit 0',
}


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in _STANDINS.items():
        f = bin_dir / name
        f.write_text(f"#!/usr/bin/env bash\n{body}\n")
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    clone = tmp_path / "clone"
    (clone / ".ci").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / ".ci" / "run", clone / ".ci" / "run")
    full_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAIL_PYTEST": "",
                "FAIL_BENCH": "", **env}
    return subprocess.run(["bash", str(clone / ".ci" / "run")], capture_output=True, text=True, env=full_env,
                          timeout=60)


def test_ci_run_passes_when_every_step_passes(tmp_path):
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr


def test_a_failing_test_pass_fails_ci_run(tmp_path):
    r = _run(tmp_path, FAIL_PYTEST="1")
    assert r.returncode == 7, (r.returncode, r.stderr)
    assert "the README's test command failed" in r.stderr


def test_a_failing_main_job_fails_ci_run(tmp_path):
    r = _run(tmp_path, FAIL_BENCH="1")
    assert r.returncode == 9, (r.returncode, r.stderr)
    assert "main-job command failed" in r.stderr
