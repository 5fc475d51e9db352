"""The peers' exact call forms: torchtune's and TRL's activation-offloading APIs.

``offload.OffloadActivations`` and ``offload.get_act_offloading_ctx_manager``
already accept both peers' documented keyword forms. These modules add the
one thing a shared signature cannot: each peer's positional order.

NOTE [ Positional peers ]
torchtune's ``OffloadActivations`` takes ``(use_pin_memory, use_streams,
max_fwd_stash_size, min_offload_size)``; TRL's takes ``(use_pin_memory,
use_streams, min_offload_size, max_fwd_stash_size)``. Both ints, both with
plausible values either way, so a positional third or fourth argument cannot
be read safely by one class. ``offload.OffloadActivations`` therefore takes
them by keyword only and raises a TypeError naming the fix when they come
positionally (every caller found in torchtune, TRL, axolotl and their tests
passes them by name or not at all). Code written against one peer's
positional order imports that peer's module here instead:

    from offload.compat.torchtune import OffloadActivations   # torchtune order
    from offload.compat.trl import OffloadActivations         # TRL order

``get_act_offloading_ctx_manager`` differs the same way: torchtune's second
positional argument is ``enable_activation_offloading``, TRL's is
``use_pin_memory``. The main function follows torchtune (the second argument
must be a bool and defaults to True, so TRL's keyword calls work unchanged);
``offload.compat.trl.get_act_offloading_ctx_manager`` has TRL's full order.
"""

from __future__ import annotations

__all__: list[str] = []


def _positional_error(args: tuple) -> TypeError:
    """More than two positional arguments: ambiguous between the peers (NOTE [ Positional peers ]
    in offload/compat/__init__.py)."""
    return TypeError(
        f"OffloadActivations: got {len(args)} positional arguments {args!r}; only use_pin_memory and "
        "use_streams may be positional. torchtune's OffloadActivations takes (..., max_fwd_stash_size, "
        "min_offload_size) in that order and TRL's takes (..., min_offload_size, "
        "max_fwd_stash_size), so a positional third or fourth value would be ambiguous. Pass "
        "them by name (OffloadActivations(max_fwd_stash_size=5, min_offload_size=1024)), or "
        "import the peer's positional order from offload.compat.torchtune or offload.compat.trl."
    )
