"""What the emulator needs to know about aten ops: which only change metadata, which allocate, which
the host reads at once, which return the arguments they write; and the poison, meta and alias
helpers it runs queued ops with. See NOTE [ Emulated streams ] in ``offload/testing/_emulator.py``."""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

_POISON = 0xFF

_METADATA_OPS = {aten.set_.source_Storage_storage_offset, aten.set_.source_Storage, aten.set_.source_Tensor,
                 aten.set_.default, aten.resize_.default, aten.resize_as_.default,
                 aten.set_.source_Tensor_storage_offset}
_EMPTY_OPS = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
              aten.new_empty_strided.default, aten.empty_like.default}


def _poison(t: Any) -> None:
    if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout is torch.strided:
        st = t.untyped_storage()
        if st.nbytes():
            torch.empty(0, dtype=torch.uint8).set_(st).fill_(_POISON)


_HOST_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}


def _host_visible(func: Any) -> bool:
    """Ops whose result the host needs now (a number, a data-dependent shape): they synchronize."""
    if func in _HOST_READS:
        return True
    tags = func.tags
    return torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags


def _returns_tensors(func: Any) -> bool:
    return any("Tensor" in str(r.type) for r in func._schema.returns)


def _mutated_returns(func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """(True, what the op returns) for an op whose returns all alias arguments it writes."""
    schema = func._schema
    by_set: dict[str, Any] = {}
    mutates = False
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            mutates = True
            val = args[i] if i < len(args) else kwargs.get(a.name)
            for s in a.alias_info.before_set:
                by_set[s] = val
    if not mutates:
        return False, None
    rets = []
    for r in schema.returns:
        if r.alias_info is None or not r.alias_info.is_write:
            return False, None
        rets.append(by_set.get(next(iter(r.alias_info.before_set))))
    if not rets:
        return True, None
    return True, rets[0] if len(rets) == 1 else tuple(rets)


def _noop() -> None:
    return None


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta") if t.device.type == "cpu" else t


def _empty_like_meta(m: torch.Tensor) -> torch.Tensor:
    if m.device.type != "meta":
        return m
    return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device="cpu")


def _alias(t: torch.Tensor) -> torch.Tensor:
    if t.layout is not torch.strided or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return t
    return aten.alias.default(t)
