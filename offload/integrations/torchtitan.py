"""torchtitan / flame: their ``activation_offload`` job-config section, mapped to this engine.

flame (fla-org/flame, a torchtitan-based trainer) has ``--activation_offload.mode``
(``"none"`` or ``"full"``), and ``"full"`` calls a copy of torchtune's helper,
``get_act_offloading_ctx_manager(model, enable_activation_offloading)``, then
runs each forward inside the returned context and backward outside it. That
helper's signature is ours, so the drop-in is one import::

    # before: from flame.models.activation_offloading import get_act_offloading_ctx_manager
    from offload import get_act_offloading_ctx_manager

    ctx = get_act_offloading_ctx_manager(model, job_config.activation_offload.mode == "full")

With this module the section may also carry engine settings (any
``OffloadConfig`` field) next to ``mode``::

    activation_offload:
      mode: full
      min_offload_size: 4096
      host_budget_bytes: 17179869184

    mode, cfg = config_from_section(job_config["activation_offload"])
    ctx = ctx_for_mode(model, mode, config=cfg)

See ``examples/torchtitan_style.py`` for a whole loop. A model under
``torch.compile`` must be given to the helper before its first compiled call
(the head exclusion hooks must be in the traced graph), or compile per block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..config import OffloadConfig, unknown_names_message
from ..engine import OffloadActivations
from ..regions import get_act_offloading_ctx_manager

__all__ = ["MODES", "config_from_section", "ctx_for_mode"]

MODES = ("none", "full")
"""Values of ``activation_offload.mode`` (torchtitan / flame)."""


def _check_mode(mode: Any) -> None:
    if mode not in MODES:
        raise ValueError(
            f"activation_offload.mode={mode!r} is not a mode: choose one of {MODES} "
            "('full' offloads every activation but the output head's)."
        )


def config_from_section(section: Mapping[str, Any]) -> tuple[str, OffloadConfig]:
    """Split an ``activation_offload`` section into its mode and an OffloadConfig of the other keys."""
    if not isinstance(section, Mapping):
        raise TypeError(f"activation_offload: expected a mapping, got {type(section).__name__}.")
    unknown = [str(k) for k in section if k != "mode" and k not in OffloadConfig.field_names()]
    if unknown:
        raise ValueError(
            f"activation_offload: unknown key(s) "
            f"{unknown_names_message(unknown, ('mode', *OffloadConfig.field_names()))}; the section takes "
            f"'mode' and OffloadConfig's fields {list(OffloadConfig.field_names())}."
        )
    if "mode" not in section:
        raise ValueError(
            f"activation_offload: the section has no 'mode' (keys: {sorted(map(str, section))}); "
            f"add 'mode: full' to offload, or 'mode: none' to leave offloading off. Without it the "
            "engine settings beside it would be silently unused."
        )
    rest = dict(section)
    mode = rest.pop("mode")
    _check_mode(mode)
    return mode, OffloadConfig.from_dict(rest)


def ctx_for_mode(
    model: nn.Module, mode: str, config: OffloadConfig | None = None, **engine_kwargs: Any
) -> "OffloadActivations | contextlib.nullcontext":
    """The context for ``activation_offload.mode``: an engine (head excluded) for "full", else a null one."""
    _check_mode(mode)
    if config is not None:
        engine_kwargs["config"] = config
    return get_act_offloading_ctx_manager(model, mode == "full", **engine_kwargs)
