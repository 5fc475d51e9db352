"""Nothing the project ships puts Python on CUDA's hot paths: importing any public module (and the bench's
command line), running with ``verify=True`` and running the emulator with its checker leave torch's GPU trace
inactive and no callback registered in ``torch.cuda._gpu_trace`` (issue 40: importing ``offload.predict`` used
to import ``torch.cuda._sanitizer``, which registers ten callbacks that fire on every CUDA allocation, free,
event record and wait of the process).

Each case runs in a fresh interpreter: ``torch._C._activate_gpu_trace`` is wrapped before anything else is
imported, so a call from anywhere (not only the callbacks left behind) is counted."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PRELUDE = """
import torch
import torch.cuda._gpu_trace as gpu_trace
activations = []
_real = torch._C._activate_gpu_trace
torch._C._activate_gpu_trace = lambda: (activations.append(1), _real())[1]

def callbacks():
    regs = [getattr(gpu_trace, n) for n in dir(gpu_trace) if hasattr(getattr(gpu_trace, n), "callback_list")]
    assert len(regs) >= 10, regs  # the registries exist: a count of 0 below means something
    return sum(len(r.callback_list) for r in regs)
"""

_IMPORTS = """
import importlib
for name in ("offload", "offload.predict", "offload.testing", "offload.planner", "offload.profiling",
             "offload.compat.torchtune", "offload.compat.trl", "offload.integrations.hf",
             "offload.integrations.torchtitan", "offload.integrations.lightning", "bench", "bench.cli",
             "bench.harness", "bench.strategies", "bench.predict", "bench.partial_offload"):
    importlib.import_module(name)
"""

_RUN = """
from torch import nn
from offload import OffloadActivations
from offload.testing import EmulatedAccelerator

model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
x = torch.randn(8, 16)
with OffloadActivations(device="cpu", min_offload_size=0, verify=True):
    loss = model(x).sum()
loss.backward()
with EmulatedAccelerator(late=True) as acc:  # the checker on: torch's sanitizer core at work
    ctx = OffloadActivations(device="cpu", min_offload_size=0, verify=True)
    with ctx:
        loss = model(x).sum()
    loss.backward()
acc.assert_no_hazards()
assert acc.summary()["ops_checked"] > 0
"""

_CHECK = """
print("activations", len(activations), "callbacks", callbacks())
"""


def _run(body: str) -> str:
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(body) + textwrap.dedent(_CHECK)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("body", [_IMPORTS, _IMPORTS + _RUN], ids=["imports", "imports+verify+emulator"])
def test_no_gpu_trace_callback_after_imports_and_checkers(body):
    """After importing every public module and bench.cli (and running verify=True and the checking emulator),
    the GPU trace was never activated and no callback is registered."""
    assert _run(body) == "activations 0 callbacks 0"


def test_the_probe_sees_the_sanitizer_import():
    """The check has teeth: importing torch.cuda._sanitizer itself activates the trace and registers callbacks."""
    line = _run("import torch.cuda._sanitizer\n")
    assert line != "activations 0 callbacks 0" and line.startswith("activations 1 callbacks ")
    assert int(line.split()[-1]) >= 10
