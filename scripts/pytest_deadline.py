"""A per-test time limit for pytest, for ``scripts/gpu_run.sh`` (``-p pytest_deadline --deadline SECONDS``).

pytest-timeout may be missing where the GPU runs (no package registry there), and the same
mechanism then runs in the CI dry-run as on the GPU. A test still running after SECONDS fails
with "exceeded the per-test deadline" (SIGALRM raises pytest's own failure in it, so ``except
Exception`` in the test cannot swallow it) and the session goes on with the next test. A test
stuck in C code (a CUDA synchronize that never returns) cannot be interrupted that way: after
SECONDS + ``--deadline-grace`` every thread's stack is written to stderr and the process exits,
so the phase's log says where it hung and the script moves on to its next phase.

Load it with ``PYTHONPATH=scripts pytest -p pytest_deadline --deadline 60``.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deadline", "per-test time limit (scripts/pytest_deadline.py)")
    group.addoption("--deadline", type=float, default=0.0,
                    help="fail a test still running after this many seconds (0: no limit)")
    group.addoption("--deadline-grace", type=float, default=30.0,
                    help="seconds after the deadline before a test stuck in C code ends the process "
                         "(stacks written to stderr)")


def _expired(seconds: float, nodeid: str):
    def handler(signum, frame):
        pytest.fail(f"{nodeid} exceeded the per-test deadline of {seconds:g} s (--deadline)", pytrace=True)

    return handler


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """The hard stop, over setup, call and teardown: stacks to stderr, then exit."""
    seconds = item.config.getoption("--deadline")
    if seconds <= 0:
        yield
        return
    faulthandler.dump_traceback_later(seconds + item.config.getoption("--deadline-grace"), exit=True,
                                      file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """The soft stop, over the test body only (an alarm inside pytest's own reporting could break
    the session): the test fails and the next one runs."""
    seconds = item.config.getoption("--deadline")
    if seconds <= 0 or not hasattr(signal, "setitimer"):
        yield
        return
    before = signal.signal(signal.SIGALRM, _expired(seconds, item.nodeid))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
