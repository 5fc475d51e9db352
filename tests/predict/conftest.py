"""Fixtures for the prediction tests (models live in predict_testkit.py)."""

from __future__ import annotations

from cpu_threads import one_cpu_thread  # autouse: one intra-op thread

__all__ = ["one_cpu_thread"]  # a fixture pytest finds here by name
