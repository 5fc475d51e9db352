"""Reliability tests run torch single-threaded.

Their models are tiny, and on the shared 2-core CI machine two intra-op
threads contend with everything else running (a 50-step run measured 15 s
with 2 threads vs 1.7 s with 1). Thread count does not change the bitwise
comparisons: twin and offloaded runs share the setting.
"""

from __future__ import annotations

from cpu_threads import one_cpu_thread  # autouse: one intra-op thread

__all__ = ["one_cpu_thread"]  # a fixture pytest finds here by name
