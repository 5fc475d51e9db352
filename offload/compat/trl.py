"""TRL's activation-offloading API with its exact signatures (positional order included).

Replace ``from trl.models.activation_offloading import OffloadActivations,
NoOpManager, get_act_offloading_ctx_manager`` with an import from here. See
NOTE [ Positional peers ] in ``offload.compat``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from torch import nn

from ..engine import OffloadActivations as _Engine
from ..regions import NoOpManager
from ..regions import get_act_offloading_ctx_manager as _get_ctx

__all__ = ["OffloadActivations", "NoOpManager", "get_act_offloading_ctx_manager"]


class OffloadActivations(_Engine):
    """``offload.OffloadActivations`` taking TRL's positional order.

    ``(use_pin_memory, use_streams, min_offload_size, max_fwd_stash_size)``;
    every other setting by keyword, as in the main class.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_size: int = 1024,
        max_fwd_stash_size: int = 5,
        **kwargs: Any,
    ) -> None:
        super().__init__(use_pin_memory, use_streams, max_fwd_stash_size=max_fwd_stash_size,
                         min_offload_size=min_offload_size, **kwargs)

    def update_model_params(self, model: nn.Module) -> None:
        """TRL's API: never offload ``model``'s parameters and buffers (same as ``model=``)."""
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"OffloadActivations.update_model_params: model must be an nn.Module, got "
                f"{type(model).__name__}."
            )
        self._model_ref = weakref.ref(model)


def get_act_offloading_ctx_manager(
    model: nn.Module,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = 1024,
    max_fwd_stash_size: int = 5,
    warn_if_no_head: bool = True,
    **kwargs: Any,
) -> "OffloadActivations | contextlib.nullcontext":
    """TRL's helper: an engine for ``model`` with its output head excluded; TRL's positional order.

    Extra settings (``device=``, ``config=``...) go by keyword, as in
    ``offload.get_act_offloading_ctx_manager``.
    """
    return _get_ctx(
        model,
        True,
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_size=min_offload_size,
        max_fwd_stash_size=max_fwd_stash_size,
        warn_if_no_head=warn_if_no_head,
        **kwargs,
    )
