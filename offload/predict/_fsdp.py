"""Many GPUs: a captured step as one rank of FSDP2, under a fake process group.

NOTE [ One FSDP2 rank ]
1. What runs. ``world_size=N > 1``: before anything is faked, a process group of the ``"fake"``
   backend (``torch.testing._internal.distributed.fake_pg``: collectives return at once and touch no
   data) is initialised as rank 0 of N, and a one-dimensional CPU ``DeviceMesh`` over it is made
   (the mesh reads its rank map with ``.tolist()``, which fake tensors cannot answer, so it is made
   first, outside fake mode). Inside the capture the built model gets ``fully_shard`` on each
   candidate block (``offload.planner.find_blocks``, the blocks ``"ac"`` checkpoints) and then on the
   root, with FSDP2's defaults (blocks reshard after forward, the root does not; implicit backward
   prefetch of the next block), before the strategy is installed. torch's ``FSDPMemTracker`` runs
   FSDP2 the same way.
2. What the trace sees. FSDP2's Python runs for real, so its all-gathers, copy-outs, reduce-scatters
   and the references it keeps between them (its prefetch and the all-gather state it holds until
   the next one) allocate and free fake storages in the order they would on a GPU. FSDP2 frees and
   re-allocates an unsharded parameter by resizing its storage (``UntypedStorage.resize_``, which no
   dispatch mode sees): the capture records a resize as a free and an allocation
   (``_capture._Capture.resized``).
3. Categories. What FSDP2 allocates while unsharding a group (``FSDPParamGroup.unshard`` and
   ``wait_for_unshard``: the all-gather buffers and the unsharded parameters) is ``parameter``;
   what it allocates in its post-backward (the reduce-scatter buffers and the sharded gradient) is
   ``gradient``, and the unsharded gradients it reduces are ``gradient`` too. Sharded state
   (``DTensor``) is counted by its local shard: the bytes of one rank.
4. Left alone. The process group is destroyed when the capture ends, returns or raises; the patched
   methods are restored. A process group already initialised (a user's own run) is refused: a
   prediction must not join it. ``world_size=1`` does not shard at all: the single-GPU prediction.
5. Not modelled. Communication time (a collective costs what its copy-in/out kernels cost, on the
   compute stream), NCCL's own buffers, and ranks other than 0 (FSDP2 pads dim 0 to a multiple of N;
   rank 0 holds the largest shard, so its bytes are an upper bound for every rank).

Private torch APIs used here, and why: ``torch.testing._internal.distributed.fake_pg.FakeStore`` (the
only store the fake backend takes; importing the module registers the backend) and
``torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup`` (the methods whose
allocations are parameters and gradients: FSDP2 has no public hook there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ._errors import PredictError

__all__ = ["check_world_size", "fake_process_group", "shard", "fsdp_categories"]


def check_world_size(world_size: int) -> int:
    """``world_size`` as an int >= 1, or a ``ValueError`` naming it."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"offload.predict: world_size={world_size!r} must be an int >= 1 (the number of GPUs "
                         "FSDP2 shards over; 1 predicts a single GPU)")
    return world_size


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """Rank 0 of a fake process group of ``world_size`` and its CPU ``DeviceMesh``, destroyed on the way
    out (NOTE [ One FSDP2 rank ] items 1 and 4)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise PredictError(
            f"offload.predict: world_size={world_size} needs its own fake process group, but a process group is "
            "already initialised in this process. Predict outside torch.distributed (before "
            "init_process_group or after destroy_process_group), e.g. in a separate process.")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def shard(model: nn.Module, mesh: Any, block_names: list[str], mixed_precision: torch.dtype | None = None) -> None:
    """``fully_shard`` each candidate block, then the root (NOTE [ One FSDP2 rank ] item 1); with
    ``mixed_precision``, FSDP2's ``MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=float32)``
    (NOTE [ Mixed precision ] item 1 in _mixed.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {} if mixed_precision is None else \
        {"mp_policy": MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)}
    for name in block_names:
        fully_shard(model.get_submodule(name), mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a ``DTensor`` (what one rank holds); any other tensor as it is."""
    return getattr(t, "_local_tensor", t)


@contextlib.contextmanager
def fsdp_categories(override: Callable[[str | None], contextlib.AbstractContextManager],
                    mark: Callable[[list[torch.Tensor], str], None]) -> Iterator[None]:
    """While FSDP2 unshards a group, what is allocated is ``parameter``; in its post-backward, ``gradient``,
    and the unsharded gradients it reduces are marked ``gradient`` (NOTE [ One FSDP2 rank ] item 3).
    ``override(category)`` is the capture's context that sets the category of new storages."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def wrap(name: str, category: str) -> Callable:
        orig = getattr(FSDPParamGroup, name)

        def method(group: Any, *args: Any, **kwargs: Any) -> Any:
            if category == "gradient":
                mark([g for fp in group.fsdp_params if (g := _unsharded_grad(fp)) is not None], "gradient")
            with override(category):
                return orig(group, *args, **kwargs)

        return orig, method

    patched = {n: wrap(n, c) for n, c in (("unshard", "parameter"), ("wait_for_unshard", "parameter"),
                                          ("post_backward", "gradient"))}
    for n, (_orig, method) in patched.items():
        setattr(FSDPParamGroup, n, method)
    try:
        yield
    finally:
        for n, (orig, _method) in patched.items():
            setattr(FSDPParamGroup, n, orig)


def _unsharded_grad(fsdp_param: Any) -> torch.Tensor | None:
    """The unsharded gradient autograd made for one FSDP2 parameter (None when it has none)."""
    g = getattr(fsdp_param, "unsharded_accumulated_grad", None)
    if g is None:
        param = getattr(fsdp_param, "_unsharded_param", None)
        g = param.grad if param is not None else None
    return g
