"""Candidate blocks: the modules ``offload.plan`` gives a decision each, found or checked.

Candidates are disjoint modules that run (a container such as ``nn.ModuleList`` never does); by
default the blocks of the model's largest ``nn.ModuleList``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["find_blocks"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _leaves(prefix: str, m: nn.Module) -> list[tuple[str, nn.Module]]:
    """The callable blocks of a (possibly nested) container, in order: a list of lists gives its leaves."""
    if not isinstance(m, _CONTAINERS):
        return [(prefix, m)]
    out = []
    for k, c in m.named_children():
        out += _leaves(f"{prefix}.{k}" if prefix else k, c)
    return out


def find_blocks(model: nn.Module, blocks: Sequence[str | nn.Module] | None = None) -> list[tuple[str, nn.Module]]:
    """Candidate blocks as (FQN, module): the given ones, or the blocks of the model's largest ``nn.ModuleList``
    (a list of lists, as in a staged model, gives its inner blocks).

    Candidates must be disjoint: one listed inside another (nested), a container (``nn.ModuleList``,
    which never runs) or the same module twice is refused, naming the modules. Candidates that never
    run, or that run inside another candidate, are refused when the step is profiled.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload.plan: model must be an nn.Module, got model={model!r} ({type(model).__name__}).")
    names = {id(m): n for n, m in model.named_modules()}
    if blocks is None:
        all_lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
        # Outermost lists only: a list of lists counts once, with its inner blocks.
        inner = {id(c) for _, m in all_lists for c in m.modules() if c is not m}
        lists = [(n, m) for n, m in all_lists if id(m) not in inner]
        if not lists:
            raise ValueError(
                f"offload.plan: {type(model).__name__} has no nn.ModuleList, so there are no default "
                "candidate blocks; pass blocks=[...] (module names or modules)."
            )
        found = [_leaves(n, m) for n, m in lists]
        return max(found, key=len)
    if isinstance(blocks, (str, nn.Module)):
        raise TypeError(f"offload.plan: blocks must be a list of module names or modules, got blocks={blocks!r}.")
    modules = dict(model.named_modules())
    out = []
    for b in blocks:
        if isinstance(b, str):
            if b not in modules:
                raise ValueError(f"offload.plan: blocks names {b!r}, which is not a submodule of the model.")
            out.append((b, modules[b]))
        elif isinstance(b, nn.Module) and id(b) in names:
            out.append((names[id(b)], b))
        else:
            raise ValueError(f"offload.plan: blocks entry {b!r} is not a submodule (or its name) of the model.")
    if not out:
        raise ValueError("offload.plan: blocks=[] names no candidate block.")
    if len({id(m) for _, m in out}) != len(out):
        raise ValueError("offload.plan: blocks lists the same module twice.")
    for n, m in out:
        if isinstance(m, _CONTAINERS):
            inner = [x for x, _ in _leaves(n, m)]
            raise ValueError(
                f"offload.plan: blocks names {n!r}, an {type(m).__name__}: a container, which never runs "
                f"(its blocks do). Name its blocks instead: {inner[:6]}{' ...' if len(inner) > 6 else ''}."
            )
    for n, m in out:
        inside = {id(x) for x in m.modules()} - {id(m)}
        for n2, m2 in out:
            if id(m2) in inside:
                raise ValueError(
                    f"offload.plan: candidate {n2!r} is inside candidate {n!r}: candidates must be disjoint "
                    "(each decision covers a whole module). Pass one of them, not both."
                )
    return out
