"""Fixtures for the prediction tests (models live in predict_testkit.py)."""

from __future__ import annotations

from cpu_threads import one_cpu_thread  # noqa: F401 (autouse: one intra-op thread)
