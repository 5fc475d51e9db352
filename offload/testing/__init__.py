"""offload.testing: check the engine's stream ordering on CPU, in CI.

An ``EmulatedAccelerator`` gives the engine's side-stream backend streams,
events and a live current stream made of CPU tensors, checks every op for a
happens-before order with PyTorch's own CUDA sanitizer core, checks frees
against queued accesses, and (``late=True``) really runs side-stream work
late, so a missing wait changes bytes. See NOTE [ Emulated streams ] in
``offload/testing/_emulator.py``.

    from offload.testing import EmulatedAccelerator
    with EmulatedAccelerator(late=True) as acc:
        ctx = OffloadActivations(device="cpu")   # the side-stream backend, emulated
        with ctx:
            loss = model(x).sum()
        loss.backward()
    acc.assert_no_hazards()

``inject_fault(name)`` switches off one ordering call of the engine (NOTE
[ Ordering faults ] in ``offload/streams.py``), for tests that prove the
checker catches its absence. Not public: everything with a leading underscore.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .. import streams as _streams
from ._checker import Hazard, HazardError
from ._emulator import EmulatedAccelerator, EmulatedEvent, EmulatedStream

__all__ = [
    # the emulator
    "EmulatedAccelerator", "EmulatedStream", "EmulatedEvent",
    # its reports
    "Hazard", "HazardError",
    # fault injection (tests of the checker)
    "inject_fault", "FAULT_NAMES",
]

FAULT_NAMES = _streams.FAULT_NAMES
"""Every ordering call ``inject_fault`` can switch off (NOTE [ Ordering faults ])."""


@contextmanager
def inject_fault(*names: str) -> Iterator[None]:
    """Switch off the named ordering calls of the engine inside the block (tests only)."""
    unknown = [n for n in names if n not in FAULT_NAMES]
    if unknown:
        raise ValueError(f"inject_fault: unknown fault(s) {unknown}; known: {list(FAULT_NAMES)}")
    added = [n for n in names if n not in _streams._FAULTS]
    _streams._FAULTS.update(added)
    try:
        yield
    finally:
        _streams._FAULTS.difference_update(added)
