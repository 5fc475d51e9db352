"""offload: activation offloading for PyTorch training, with built-in accounting.

Public API, grouped. Everything else (modules and names starting with ``_``,
the copy backends in ``offload.streams``) is internal and may change.
"""

# The engine and its error
from .engine import OffloadActivations, PackEvent, active_engine, add_pack_observer
from .errors import OffloadError

# Regions that stay on the device (torchtune-compatible helpers included)
from .regions import NoOpManager, RegionHandle, find_output_head, get_act_offloading_ctx_manager

# Accounting
from .ledger import Ledger, PackRecord, StepTotals
from .pool import HostBuffer, HostPool

# Policy and module scopes, shared with the profilers
from .modules import current_module_name, current_modules, track_modules
from .policy import REASONS, is_static_tensor

# The memory-budget planner (offload.planner)
from .planner import Plan, plan

__all__ = [
    # engine
    "OffloadActivations",
    "OffloadError",
    "PackEvent",
    "active_engine",
    "add_pack_observer",
    # regions
    "NoOpManager",
    "RegionHandle",
    "find_output_head",
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
    # planner
    "plan",
    "Plan",
]
