"""offload: activation offloading for PyTorch training, with built-in accounting.

Public API, grouped. Everything else (modules and names starting with ``_``,
the copy backends in ``offload.streams``) is internal and may change.
Framework integrations live in ``offload.integrations`` (``hf``, ``lightning``)
and the peers' exact signatures in ``offload.compat`` (``torchtune``, ``trl``);
the profilers in ``offload.profiling`` (the repository's ``profiling/`` folder).
"""

from importlib import metadata as _metadata

try:
    __version__: str = _metadata.version("offload")
    """The installed distribution's version (``pyproject.toml``)."""
except _metadata.PackageNotFoundError:  # run from a checkout without ``pip install``
    __version__ = "0.1.0"

from . import _source_tree

_source_tree.install()  # from a checkout, the repo's profiling/ folder is offload.profiling (as in the wheel)

import logging as _logging

# Library logging: information goes to the "offload" logger hierarchy, silent
# unless the application configures logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

# The engine, its settings and its error
from .engine import OffloadActivations, PackEvent, active_engine, add_pack_observer
from .config import OffloadConfig
from .attach import AttachHandle
from .errors import OffloadError
from ._verify import OffloadVerifyError

# Regions that stay on the device (torchtune-compatible helpers included)
from .regions import NoOpManager, RegionHandle, find_backbone, find_output_head, get_act_offloading_ctx_manager

# Accounting
from .ledger import Ledger, PackRecord, StepTotals
from .pool import HostBuffer, HostPool

# Policy and module scopes, shared with the profilers
from .modules import current_module_name, current_modules, module_name, register_model, track_modules
from .policy import REASONS, is_static_tensor

# The memory-budget planner (offload.planner)
from .planner import Plan, plan

# Long context: the MLP and the loss in tiles, and the whole strategy in one call
from .tiling import TilingHandle, linear_cross_entropy, tile_loss, tile_mlp
from ._long_context import LongContextHandle, long_context

__all__ = [
    "__version__",
    # engine
    "OffloadActivations",
    "OffloadConfig",
    "AttachHandle",
    "OffloadError",
    "OffloadVerifyError",
    "PackEvent",
    "active_engine",
    "add_pack_observer",
    # regions
    "NoOpManager",
    "RegionHandle",
    "find_output_head",
    "find_backbone",
    "get_act_offloading_ctx_manager",
    # accounting
    "Ledger",
    "PackRecord",
    "StepTotals",
    "HostPool",
    "HostBuffer",
    # shared with profilers
    "REASONS",
    "is_static_tensor",
    "track_modules",
    "current_module_name",
    "current_modules",
    "register_model",
    "module_name",
    # planner
    "plan",
    "Plan",
    # long context
    "tile_mlp",
    "tile_loss",
    "linear_cross_entropy",
    "TilingHandle",
    "long_context",
    "LongContextHandle",
]
