"""Fixtures for the integration tests (attach, config, HF / Lightning / peers' call forms)."""

from __future__ import annotations

import sys
from pathlib import Path

# The engine tests' shared helpers (toy models, bitwise grad checks).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "offload"))

from cpu_threads import one_cpu_thread  # autouse: one intra-op thread

__all__ = ["one_cpu_thread"]  # a fixture pytest finds here by name
