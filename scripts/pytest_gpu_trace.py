"""Records, at the end of a pytest process, whether torch's GPU trace had Python callbacks registered, and
fails the session when that is not what the phase expects (``scripts/gpu_run.sh``: the ``gpu`` tests must run
without them, the sanitizer phase with them).

    PYTHONPATH=.:scripts pytest -p pytest_gpu_trace --gpu-trace off --gpu-trace-record trace.json ...

Why: importing ``torch.cuda._sanitizer`` (or ``TORCH_CUDA_SANITIZER=1``) registers ten Python callbacks in
``torch.cuda._gpu_trace`` that run on every CUDA allocation, free, event record and wait of the process, on
autograd's device threads too. The H200 runs had them on in every test (issue 40), and they are the first
suspect for the ``SystemError`` of the in-place tests, so a test log means something only with the state it
ran in beside it. ``torch._C._activate_gpu_trace`` is wrapped when this plugin loads (before any test module
is imported), so an activation from anywhere during the session is counted, not only callbacks left behind.

``--gpu-trace off``: the session fails (exit status 1) if, at its end, any callback is registered, the trace
was activated during the session, or ``torch.cuda._sanitizer`` is imported. ``on``: it fails if no callback
is registered (a sanitizer phase that ran without the sanitizer). ``any`` (default): only recorded. The
record (``bench.env.gpu_trace_state()`` plus ``activations_during_session`` and ``expected``) is written to
``--gpu-trace-record`` and summarised on the terminal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

_activations: list[int] = []
_real_activate = torch._C._activate_gpu_trace


def _counting_activate() -> None:
    _activations.append(1)
    _real_activate()


torch._C._activate_gpu_trace = _counting_activate


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu-trace", "torch's GPU-trace callbacks (scripts/pytest_gpu_trace.py)")
    group.addoption("--gpu-trace", choices=("off", "on", "any"), default="any",
                    help="off: fail if any GPU-trace callback is registered or the trace was activated (the gpu "
                         "tests); on: fail if none is (the sanitizer phase); any: record only")
    group.addoption("--gpu-trace-record", default=None, help="JSON file to write the state at the session's end to")


def _verdict(state: dict, expected: str) -> str:
    """Why the state breaks the expectation ("" when it does not)."""
    if expected == "off":
        why = []
        if state["callbacks"]:
            why.append(f"{state['callbacks']} callback(s) registered ({', '.join(state['registries'])})")
        if state["activations_during_session"]:
            why.append(f"the trace was activated {state['activations_during_session']} time(s) during the session")
        if state["sanitizer_imported"]:
            why.append("torch.cuda._sanitizer is imported")
        return "; ".join(why)
    if expected == "on" and not state["callbacks"]:
        return "no callback is registered: the sanitizer was not on (is TORCH_CUDA_SANITIZER=1 set?)"
    return ""


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from bench.env import gpu_trace_state

    config = session.config
    expected = config.getoption("--gpu-trace")
    state = {**gpu_trace_state(), "activations_during_session": len(_activations), "expected": expected}
    state["violation"] = _verdict(state, expected)
    path = config.getoption("--gpu-trace-record")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(state, indent=1) + "\n")
    line = (f"gpu trace at the end of this test process: {state['callbacks']} callback(s), "
            f"{state['activations_during_session']} activation(s) during the session, torch.cuda._sanitizer "
            f"{'imported' if state['sanitizer_imported'] else 'not imported'} (expected: {expected})")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
        if state["violation"]:
            reporter.write_line(f"GPU TRACE CHECK FAILED (--gpu-trace {expected}): {state['violation']}", red=True)
    if state["violation"] and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
