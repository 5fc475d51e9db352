"""torchtune's activation-offloading API with its exact signatures (positional order included).

Replace ``from torchtune.training import OffloadActivations, NoOpManager,
get_act_offloading_ctx_manager`` with an import from here. See NOTE
[ Positional peers ] in ``offload.compat``.
"""

from __future__ import annotations

from typing import Any

from ..engine import OffloadActivations as _Engine
from ..regions import NoOpManager, get_act_offloading_ctx_manager

__all__ = ["OffloadActivations", "NoOpManager", "get_act_offloading_ctx_manager"]


class OffloadActivations(_Engine):
    """``offload.OffloadActivations`` taking torchtune's positional order.

    ``(use_pin_memory, use_streams, max_fwd_stash_size, min_offload_size)``;
    every other setting by keyword, as in the main class. ``max_fwd_stash_size`` defaults to None (no
    cap: torchtune's 5 made compute wait on the oldest copy beyond five; NOTE [ Copy schedule ] waits only
    where device memory needs it); a value given is kept as a cap.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        max_fwd_stash_size: int | None = None,
        min_offload_size: int = 1024,
        **kwargs: Any,
    ) -> None:
        super().__init__(use_pin_memory, use_streams, max_fwd_stash_size=max_fwd_stash_size,
                         min_offload_size=min_offload_size, **kwargs)
