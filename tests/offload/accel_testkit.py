"""The accelerator a shared ordering test runs on: a CUDA GPU, or offload.testing's emulator.

Ordering and lifetime tests take the ``accel`` fixture (tests/offload/conftest.py) and are written
once: on a CUDA machine they run on the GPU (marked ``gpu``), and everywhere they also run on an
``EmulatedAccelerator`` in late-data mode with the happens-before checker on (marked ``emulated``),
which must report no hazard. Sizes shrink on the emulator (``accel.n``); what a GPU test forces with
``torch.cuda._sleep`` the emulator forces by parking the stream (late data).
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import torch

from bench.model import ToyLlamaConfig
from offload import OffloadActivations
from offload.testing import EmulatedAccelerator

__all__ = ["Accel", "SLEEP_CYCLES"]

SLEEP_CYCLES = int(2e8)
"""torch.cuda._sleep cycles: ~100 ms at H100 clocks, far longer than any copy here."""

GPU_CFG = ToyLlamaConfig(vocab_size=2048, dim=512, n_layers=4, n_heads=8, max_seq_len=1024)
"""Toy Llama big enough that copies take real time on an H100, small enough for seconds per test."""
EMU_CFG = ToyLlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, max_seq_len=64)
"""The emulator's toy Llama: every op is checked in Python, so ms-scale."""


class Accel:
    """One accelerator for a test body: ``kind`` is "cuda" or "emulated"."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.emulator: EmulatedAccelerator | None = None
        if kind == "cuda":
            self.mod: Any = torch.cuda
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.cfg, self.batch_shape = GPU_CFG, (4, 512)
        else:
            self.emulator = EmulatedAccelerator(late=True)
            self.mod = self.emulator
            self.device = torch.device("cpu")
            self.cfg, self.batch_shape = EMU_CFG, (2, 16)

    @property
    def emulated(self) -> bool:
        return self.emulator is not None

    def __enter__(self) -> "Accel":
        if self.emulator is not None:
            self.emulator.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.emulator is not None:
            self.emulator.__exit__(*exc)

    # -- sizes ---------------------------------------------------------------------

    def n(self, gpu_numel: int) -> int:
        """An element count: ``gpu_numel`` on a GPU, at most 16k on the emulator."""
        return gpu_numel if not self.emulated else min(gpu_numel, 1 << 14)

    def cfg_with(self, **changes: Any) -> ToyLlamaConfig:
        return dataclasses.replace(self.cfg, **changes)

    # -- the engine ------------------------------------------------------------------

    def ctx(self, **kw: Any) -> OffloadActivations:
        kw.setdefault("device", self.device)
        kw.setdefault("min_offload_size", 0)
        ctx = OffloadActivations(**kw)
        assert ctx.backend == ("stream" if kw.get("use_streams", True) else "sync"), ctx.backend
        return ctx

    # -- streams -----------------------------------------------------------------------

    def Stream(self) -> Any:  # noqa: N802
        """A compute stream of the test's own (not a side stream: on the emulator its work runs when issued)."""
        return self.mod.Stream(late=False) if self.emulated else torch.cuda.Stream()

    def stream(self, s: Any) -> Any:
        return self.mod.stream(s)

    def current_stream(self) -> Any:
        return self.mod.current_stream()

    def synchronize(self) -> None:
        self.mod.synchronize()

    def sleep(self, cycles: int = SLEEP_CYCLES) -> None:
        """Park the current stream: what is queued on it next runs long after the host moved on."""
        self.mod._sleep(cycles)

    def poison_free_blocks(self, nbytes: int, stream: Any = None, count: int = 8) -> None:
        """Make the next same-size allocations hold NaN (the emulator poisons every allocation already)."""
        if self.emulated:
            return
        stream = stream or torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            ts = [torch.full((nbytes // 4,), float("nan"), device="cuda") for _ in range(count)]
            del ts
        stream.synchronize()

    def memory_allocated(self) -> int | None:
        """Device bytes allocated (None on the emulator: CPU memory has no such counter)."""
        return None if self.emulated else torch.cuda.memory_allocated()

    def settle(self, ctx: OffloadActivations | None = None) -> None:
        """Synchronize, collect; the pool holds nothing in use."""
        self.synchronize()
        gc.collect()
        if ctx is not None:
            assert ctx.pool.stats()["in_use_bytes"] == 0, ctx.pool.stats()

    def expect_hazard(self, kind: str, ops: tuple[str, str]) -> None:
        """The test raced on purpose: on the emulator the checker reported exactly that (then forget it)."""
        if self.emulator is None:
            return
        hazards = self.emulator.hazards
        assert hazards and all(h.kind == kind and h.ops == ops for h in hazards), (
            f"expected only {kind} {ops}, got {[(h.kind, h.ops) for h in hazards]}")
        self.emulator.clear()

    def check(self) -> None:
        """The emulator saw no ordering hazard (a GPU has no such check: its bytes must be right)."""
        if self.emulator is not None:
            self.emulator.assert_no_hazards()
