"""One way to say a size (NOTE [ Sizes ] in offload/sizes.py), walked over every public size setting on
every surface a user can give it: the size settings are OffloadConfig's fields annotated ``Bytes`` and the
surfaces are found in each public package's ``__all__``, so a new one is walked (or fails here) by itself."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
from decimal import Decimal
from typing import Any, Callable

import psutil
import pytest
import torch
import yaml
from torch import nn

import offload
from offload import OffloadActivations, OffloadConfig
from offload.config import SIZE_FIELDS
from offload.sizes import SHARE_FORMS, SIZE_FORMS, SIZE_LIMIT, to_bytes

GOOD = [
    (2_000_000_000, 2_000_000_000), (2e9, 2_000_000_000), (1.5e9, 1_500_000_000), ("2e9", 2_000_000_000),
    ("2GB", 2_000_000_000), ("16GiB", 16 << 30), ("4.1GB", 4_100_000_000), ("16.1GB", 16_100_000_000),
    ("8.2MB", 8_200_000), ("16.1KB", 16_100), ("512 mb", 512_000_000), ("1.5GiB", 3 << 29), ("1_024", 1024),
    ("4096", 4096),
]
"""(what a user writes, the bytes it means): every form of NOTE [ Sizes ] rules 1-3."""
BAD = [(1.5, "not a whole number of bytes"), ("16G", "ambiguous"), ("16Gi", "'16GiB'"), ("2 GiBs", "not a unit"),
       ("1.0000001KB", "not a whole number"), ("GiB", "not a number"), (True, "a bool is not a size")]
"""(a value that is no size, what the error says about it)."""

PUBLIC_MODULES = ("offload", "offload.planner", "offload.integrations", "offload.integrations.hf",
                  "offload.integrations.lightning", "offload.integrations.torchtitan", "offload.compat",
                  "offload.compat.torchtune", "offload.compat.trl", "offload.testing")
BUDGETS = ("budget_bytes", "budget")
"""Parameter names of a memory budget (a size or a share, NOTE [ Sizes ] rule 4)."""
NOT_SETTINGS = {
    "offload.StepTotals", "offload.PackRecord", "offload.Plan", "offload.planner.Plan",
    "offload.planner.StepMeasurement", "offload.planner.CostModel", "offload.Ledger.add",
    "offload.Ledger.close_step", "offload.StepTotals.add",
}
"""Public callables with a ``*_bytes`` parameter that is a measured figure, not a setting: records the
library builds from what it measured (a user reads them, never writes one)."""
NOT_SETTINGS_KWARGS = {"offload.OffloadError", "offload.integrations.hf.OffloadCallback.on_train_begin",
                       "offload.integrations.hf.OffloadCallback.on_train_end",
                       "offload.integrations.hf.OffloadCallback.on_log"}
"""Public callables whose ``**kwargs`` are not engine settings (an exception's, transformers' events)."""


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _yaml_text(value: Any) -> str:
    """``value`` as a person types it in yaml (unquoted)."""
    return value if isinstance(value, str) else repr(value)


class _Captured(Exception):
    """Raised by a stand-in to hand back what a function was called with."""


def _captured(monkeypatch, target: Any, attr: str, pick: Callable[..., Any]) -> Callable[[Callable[[], Any]], Any]:
    """Replace ``target.attr`` with a stand-in raising ``_Captured(pick(*args, **kwargs))``; the returned
    function runs a call and returns what was picked."""
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise _Captured(pick(*args, **kwargs))

    monkeypatch.setattr(target, attr, stand_in)

    def run(call: Callable[[], Any]) -> Any:
        with pytest.raises(_Captured) as ei:
            call()
        return ei.value.args[0]
    return run


def _plan_surface(monkeypatch, param: str) -> Callable[[str, Any], int]:
    """``offload.plan`` with ``param`` set: the bytes it plans with (the planning itself replaced)."""
    from offload.planner import planning

    run = _captured(monkeypatch, planning, "_plan_checked", lambda m, s, c, budget, dev, ekw, **kw: (budget, ekw))
    model = _model()

    def call(name: str, value: Any) -> int:
        if param == "budget_bytes":
            return run(lambda: offload.plan(model, lambda: model(torch.ones(1, 4)).sum(), budget_bytes=value, blocks=["0"]))[0]
        kw = {"engine_kwargs": {name: value}} if param == "engine_kwargs" else {name: value}
        return run(lambda: offload.plan(model, lambda: model(torch.ones(1, 4)).sum(), budget_bytes=1 << 30, blocks=["0"], **kw))[1][name]
    return call


def _callback_budget(monkeypatch, module: str) -> Callable[[str, Any], int]:
    """An OffloadCallback's ``budget_bytes``/``budget``: the bytes its first step plans under."""
    cls = pytest.importorskip(module).OffloadCallback
    from offload.integrations import _plan

    run = _captured(monkeypatch, _plan, "plan", lambda model, step, budget_bytes, **kw: budget_bytes)
    model = _model()

    def call(name: str, value: Any) -> int:
        cb = cls(**{name: value})
        return run(lambda: cb.planner.before_step(model, lambda: model(torch.ones(1, 4)).sum(), torch.ones(2, 4)))
    return call


def _surfaces(monkeypatch) -> dict[str, tuple[tuple[str, ...], Callable[[str, Any], int]]]:
    """Surface name -> (the size parameters it takes, call(name, value) -> the bytes it stores)."""
    from offload.compat import torchtune, trl
    from offload.integrations import torchtitan
    from offload.planner import planning

    cpu = {"device": "cpu"}
    engine = lambda make: lambda n, v: make(n, v).config.__getattribute__(n)  # noqa: E731
    out: dict[str, tuple[tuple[str, ...], Callable[[str, Any], int]]] = {
        "offload.OffloadConfig": (SIZE_FIELDS, lambda n, v: getattr(OffloadConfig(**{n: v}), n)),
        "offload.OffloadConfig.replace": (SIZE_FIELDS, lambda n, v: getattr(OffloadConfig().replace(**{n: v}), n)),
        "offload.OffloadConfig.from_dict": (SIZE_FIELDS, lambda n, v: getattr(OffloadConfig.from_dict({n: v}), n)),
        "offload.OffloadConfig.from_yaml": (
            SIZE_FIELDS, lambda n, v: getattr(OffloadConfig.from_yaml(f"{n}: {_yaml_text(v)}\n"), n)),
        "offload.OffloadActivations": (SIZE_FIELDS, engine(lambda n, v: OffloadActivations(**cpu, **{n: v}))),
        "offload.get_act_offloading_ctx_manager": (SIZE_FIELDS, engine(
            lambda n, v: offload.get_act_offloading_ctx_manager(_model(), True, **cpu, **{n: v}))),
        "offload.compat.torchtune.OffloadActivations": (
            SIZE_FIELDS, engine(lambda n, v: torchtune.OffloadActivations(**cpu, **{n: v}))),
        "offload.compat.torchtune.get_act_offloading_ctx_manager": (SIZE_FIELDS, engine(
            lambda n, v: torchtune.get_act_offloading_ctx_manager(_model(), True, **cpu, **{n: v}))),
        "offload.compat.trl.OffloadActivations": (
            SIZE_FIELDS, engine(lambda n, v: trl.OffloadActivations(**cpu, **{n: v}))),
        "offload.compat.trl.get_act_offloading_ctx_manager": (SIZE_FIELDS, engine(
            lambda n, v: trl.get_act_offloading_ctx_manager(_model(), **cpu, **{n: v}))),
        # A torchtitan job's yaml, read as torchtitan reads it (PyYAML's safe_load: 2e9 is a string there).
        "offload.integrations.torchtitan.config_from_section": (SIZE_FIELDS, lambda n, v: getattr(
            torchtitan.config_from_section(yaml.safe_load(f"mode: full\n{n}: {_yaml_text(v)}\n"))[1], n)),
        "offload.integrations.torchtitan.ctx_for_mode": (
            SIZE_FIELDS, engine(lambda n, v: torchtitan.ctx_for_mode(_model(), "full", **cpu, **{n: v}))),
        "offload.plan": (("budget_bytes", "min_offload_size", "host_budget_bytes"),
                         lambda n, v: _plan_surface(monkeypatch, n)(n, v)),
        "offload.plan(engine_kwargs)": (SIZE_FIELDS, _plan_surface(monkeypatch, "engine_kwargs")),
        "offload.HostPool": (("capacity_bytes",), lambda n, v: offload.HostPool(pin=False, **{n: v}).capacity_bytes),
        "offload.long_context": (SIZE_FIELDS, engine(lambda n, v: _long_context_engine(**cpu, **{n: v}))),
    }
    out["offload.planner.plan"] = out["offload.plan"]
    run = _captured(monkeypatch, planning, "_solve", lambda cost, budget, *a, **kw: budget)
    out["offload.planner.plan_from_cost"] = (("budget_bytes",), lambda n, v: run(lambda: planning.plan_from_cost(
        None, v, model=None, device="cpu", unplanned_peak=0, unplanned_s=0.0)))
    if importlib.util.find_spec("trl") is not None:
        def sft_patch(n: str, v: Any) -> int:
            with trl.patch_sft_trainer(**cpu, **{n: v}) as patch:
                return patch._build(_model()).config.__getattribute__(n)
        out["offload.compat.trl.patch_sft_trainer"] = (SIZE_FIELDS, sft_patch)
    for module in ("offload.integrations.hf", "offload.integrations.lightning"):
        if importlib.util.find_spec(module.rsplit(".", 1)[1].replace("hf", "transformers")) is None:
            continue
        cls = importlib.import_module(module).OffloadCallback
        out[f"{module}.OffloadCallback"] = (SIZE_FIELDS, lambda n, v, cls=cls: getattr(cls(**cpu, **{n: v}).config, n))
        out[f"{module}.OffloadCallback(budget)"] = (("budget_bytes",), _callback_budget(monkeypatch, module))
    return out


def _long_context_engine(**settings: Any) -> OffloadActivations:
    """The engine ``offload.long_context`` builds from its settings (the handle removed at once)."""
    model = _model()
    handle = offload.long_context(model, tiled_mlp=False, tiled_loss=False, exclude_head=False,
                                  blocks=[("0", model[0])], **settings)
    handle.remove()
    return handle.engine


def _public_size_parameters() -> set[tuple[str, str]]:
    """(callable, parameter) for every public callable taking a size (a ``Bytes`` setting's name, a
    ``*_bytes`` or budget name) or engine settings (``**kwargs``)."""
    found = set()
    for modname in PUBLIC_MODULES:
        mod = importlib.import_module(modname)
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name)
            calls = [(f"{modname}.{name}", obj)] if callable(obj) else []
            if inspect.isclass(obj):
                calls += [(f"{modname}.{name}.{k}", getattr(obj, k)) for k in vars(obj)
                          if not k.startswith("_") and inspect.isroutine(getattr(obj, k))]
            for qual, fn in calls:
                try:
                    params = inspect.signature(fn).parameters.values()
                except (TypeError, ValueError):
                    continue
                for p in params:
                    if (p.name in SIZE_FIELDS or p.name.endswith("_bytes") or p.name in BUDGETS
                            or p.kind is p.VAR_KEYWORD):
                        found.add((qual, "**" if p.kind is p.VAR_KEYWORD else p.name))
    return found


def test_size_settings_are_found_from_the_dataclass():
    """Every OffloadConfig field named like a size (``*_bytes``, ``*_size`` but the tensor count) is a
    ``Bytes`` field, and so parsed: a new size setting typed ``int`` fails here."""
    counts = {"max_fwd_stash_size", "max_records"}
    ints = {f.name for f in dataclasses.fields(OffloadConfig) if "int" in str(f.type) or "Bytes" in str(f.type)}
    named = {f.name for f in dataclasses.fields(OffloadConfig) if f.name.endswith(("_bytes", "_size"))}
    assert set(SIZE_FIELDS) == ints - counts == named - counts, (SIZE_FIELDS, ints, named)


def test_every_public_size_parameter_is_walked(monkeypatch):
    """Each public callable taking a size (found from ``__all__``) is a surface the walk below covers,
    or a record of measured figures; ``**kwargs`` surfaces walk every size setting."""
    surfaces = _surfaces(monkeypatch)
    optional = {"offload.integrations.hf", "offload.integrations.lightning", "offload.compat.trl.patch_sft_trainer"}
    missing = []
    for qual, param in sorted(_public_size_parameters()):
        owner = qual.rsplit(".", 1)[0] if qual.rsplit(".", 1)[1] == "__init__" else qual
        if owner in NOT_SETTINGS or (param == "**" and qual in NOT_SETTINGS_KWARGS):
            continue
        if owner.startswith(tuple(optional)) and not any(s.startswith(owner) for s in surfaces):
            continue  # its framework is not installed
        walked = [params for name, (params, _) in surfaces.items() if name.split("(")[0] == owner]
        want = SIZE_FIELDS if param in ("**", "engine_kwargs") else (param,)
        if not any(set(want) <= set(p) for p in walked) and not (param == "budget" and walked):
            missing.append((qual, param))
    assert not missing, f"public size parameters no surface walks: {missing}"


def _surface_ids() -> list[str]:
    mp = pytest.MonkeyPatch()
    try:
        return list(_surfaces(mp))
    finally:
        mp.undo()


@pytest.mark.parametrize("surface", _surface_ids())
def test_every_size_form_means_the_same_bytes_on_every_surface(monkeypatch, surface):
    """On each surface, each size setting reads every accepted form as the same whole number of bytes,
    and refuses every non-size with the one wording: the surface, the setting, the value, the forms."""
    params, call = _surfaces(monkeypatch)[surface]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no output head in the toy model: not what is checked
        for name in params:
            for value, nbytes in GOOD:
                got = call(name, value)
                assert got == nbytes and type(got) is int, (surface, name, value, got)
            for value, why in BAD:
                with pytest.raises((TypeError, ValueError)) as ei:
                    call(name, value)
                msg = str(ei.value)
                assert name in msg and f"{value!r} is invalid" in msg and why in msg and SIZE_FORMS in msg, (surface, msg)
                assert msg.startswith(("OffloadConfig:", "offload.plan", "OffloadCallback:", "HostPool:",
                                       "OffloadActivations:")), msg
                # The error names what the user called: an engine built from arguments, or a config.
                if surface.endswith(("OffloadActivations", "get_act_offloading_ctx_manager", "ctx_for_mode")):
                    assert msg.startswith("OffloadActivations:"), (surface, msg)
                elif surface.startswith("offload.OffloadConfig"):
                    assert msg.startswith("OffloadConfig:"), (surface, msg)
                if name in BUDGETS:
                    assert SHARE_FORMS in msg, msg


@pytest.mark.parametrize("unit,scale", [("MB", 10**6), ("GB", 10**9), ("KB", 10**3)])
def test_decimal_sizes_are_exact(unit, scale):
    """Every ``x.y`` with x < 100 and a decimal unit is exactly (10x + y) * scale / 10 bytes: decimal
    arithmetic, never a binary float just below a whole number (62 of these were refused before)."""
    for x in range(100):
        for y in range(10):
            text = f"{x}.{y}{unit}"
            assert to_bytes(text, "host_budget_bytes") == (10 * x + y) * scale // 10, text


def test_a_share_is_a_budget_only_and_both_spellings_agree(monkeypatch):
    """``"80%"`` and ``0.8`` are the same share of the device (host RAM on CPU) for ``plan``; a share is
    refused where a size is meant (an engine setting), and ``1.0`` is a share while ``1`` is one byte."""
    call = _plan_surface(monkeypatch, "budget_bytes")
    total = psutil.virtual_memory().total
    assert call("budget_bytes", "80%") == call("budget_bytes", 0.8) == int(Decimal("0.8") * total)
    assert call("budget_bytes", 1.0) == total and call("budget_bytes", 1) == 1
    with pytest.raises(ValueError, match="host_budget_bytes='80%'"):
        OffloadConfig(host_budget_bytes="80%")
    with pytest.raises(ValueError, match=r"share must be in \(0, 1\]"):
        call("budget_bytes", "120%")


def test_the_largest_size_is_the_limit_in_every_form():
    """``SIZE_LIMIT`` is accepted and one more byte is refused, however it is written."""
    assert to_bytes(str(SIZE_LIMIT), "x") == SIZE_LIMIT
    for too_big in (SIZE_LIMIT + 1, str(SIZE_LIMIT + 1), "9.3e18", "10000000TB", 1e19):
        with pytest.raises(ValueError, match=str(SIZE_LIMIT)):
            to_bytes(too_big, "x")
