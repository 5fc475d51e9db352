"""OffloadConfig: every engine setting, validated by name, round-tripped through dict and yaml."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch
from torch import nn

from offload import OffloadActivations, OffloadConfig, get_act_offloading_ctx_manager
from offload.config import SIZE_LIMIT
from offload_testkit import MLP, assert_really_offloaded, assert_same_grads, make_inputs, run_step, twin_of


def test_config_has_every_engine_setting():
    """Every OffloadActivations argument but model (and config) is an OffloadConfig field, same default."""
    params = inspect.signature(OffloadActivations.__init__).parameters
    engine = {n: p.default for n, p in params.items()
              if n not in ("self", "model", "config", "positional")}
    fields = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}
    assert engine == fields


def test_every_field_has_a_docstring():
    """Each field is followed by a one-line docstring in the source (what it means, its unit)."""
    src = inspect.getsource(OffloadConfig)
    for f in dataclasses.fields(OffloadConfig):
        after = src.split(f"    {f.name}:", 1)[1].splitlines()[1].strip()
        assert after.startswith('"""') and after.endswith('"""') and len(after) > 12, f.name


def test_frozen_and_keyword_only():
    """A config cannot be changed in place (replace() makes a validated copy) nor built positionally."""
    cfg = OffloadConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.min_offload_size = 0
    with pytest.raises(TypeError):
        OffloadConfig(True)
    assert cfg.replace(min_offload_size=0).min_offload_size == 0
    with pytest.raises(ValueError, match="min_offload_size"):
        cfg.replace(min_offload_size=-1)


BAD = [
    ("virtual_memory_safe_pct", "50"),
    ("virtual_memory_safe_pct", True),
    ("virtual_memory_safe_pct", 0),
    ("use_pin_memory", "yes"),
    ("use_streams", 1),
    ("dedupe", None),
    ("timing", "False"),
    ("max_fwd_stash_size", True),
    ("max_fwd_stash_size", 2.0),
    ("min_offload_size", "1024 bytes"),
    ("max_inflight_bytes", 0),
    ("prefetch_bytes", 1.5),
    ("host_budget_bytes", False),
    ("max_records", -1),
    ("on_host_budget", 1),
    ("on_host_budget", "spill"),
    ("pin_allocator", None),
    ("device", True),
    ("device", 3.5),
    ("device", "nonsense"),
    ("pageable_budget_bytes", -1),
    ("pageable_budget_bytes", "1G"),
    ("disk_dir", 3),
    ("disk_dir", ""),
    ("disk_budget_bytes", -5),
    ("disk_queue_bytes", 0),
    ("disk_readahead_bytes", 1.5),
]


VIAS = ["config", "engine", "from_dict"]
"""The three ways a setting reaches the engine."""


def _build(via: str, name: str, value: object) -> None:
    """Build ``name=value`` the way ``via`` names: OffloadConfig, the engine's keywords, or from_dict."""
    if via == "config":
        OffloadConfig(**{name: value})
    elif via == "engine":
        OffloadActivations(**{"device": "cpu", name: value})
    else:
        OffloadConfig.from_dict({name: value})


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
@pytest.mark.parametrize("via", VIAS)
def test_bad_value_names_the_setting(name, value, via):
    """A wrong type or value is refused at construction, naming the setting and the value."""
    with pytest.raises((TypeError, ValueError)) as ei:
        _build(via, name, value)
    msg = str(ei.value)
    assert name in msg and repr(value) in msg, msg


def test_model_must_be_a_module():
    """model="oops" is refused at construction with a message naming model."""
    with pytest.raises(TypeError, match=r"model='oops'"):
        OffloadActivations(device="cpu", model="oops")
    with pytest.raises(TypeError, match="model"):
        get_act_offloading_ctx_manager(nn.Linear(2, 2), True, device="cpu", model=42)


def test_from_dict_rejects_unknown_keys_listing_valid_ones():
    """A misspelt key fails, naming it and the valid settings."""
    with pytest.raises(ValueError) as ei:
        OffloadConfig.from_dict({"min_offload_bytes": 0, "device": "cpu"})
    msg = str(ei.value)
    assert "min_offload_bytes" in msg and "min_offload_size" in msg and "host_budget_bytes" in msg


def test_dict_and_yaml_round_trip():
    """to_dict/from_dict and to_yaml/from_yaml give back an equal config."""
    cfg = OffloadConfig(device=torch.device("cpu"), min_offload_size=0, prefetch_bytes=0,
                        host_budget_bytes=1 << 20, on_host_budget="pageable", virtual_memory_safe_pct=None)
    assert cfg.device == "cpu"  # normalised to a string: yaml-safe
    assert OffloadConfig.from_dict(cfg.to_dict()) == cfg
    text = cfg.to_yaml()
    assert "on_host_budget: pageable" in text
    assert OffloadConfig.from_yaml(text) == cfg
    assert OffloadConfig.from_yaml("") == OffloadConfig()


def test_engine_from_config_matches_kwargs_and_is_bitwise():
    """OffloadActivations(config=...) and from_config() set exactly what the same kwargs set; grads bitwise."""
    cfg = OffloadConfig(device="cpu", min_offload_size=0, max_fwd_stash_size=2, use_streams=False)
    model = MLP()
    twin = twin_of(model)
    a = OffloadActivations.from_config(cfg, model=model)
    b = OffloadActivations(config=cfg)
    c = OffloadActivations(device="cpu", min_offload_size=0, max_fwd_stash_size=2, use_streams=False)
    for e in (a, b, c):
        assert e.config == cfg
        assert (e.min_offload_size, e.max_fwd_stash_size, e.use_streams) == (0, 2, False)
        assert e.device == torch.device("cpu")
    inputs = make_inputs("mlp")
    run_step(model, inputs, a)
    run_step(twin, inputs)
    assert_same_grads(model, twin)
    assert_really_offloaded(a)


def test_config_and_conflicting_kwargs_rejected():
    """A setting given both as an argument and through config= is an error, not a silent choice."""
    with pytest.raises(TypeError, match="min_offload_size"):
        OffloadActivations(config=OffloadConfig(device="cpu"), min_offload_size=0)
    with pytest.raises(TypeError, match="OffloadConfig"):
        OffloadActivations(config={"device": "cpu"})


def _warned(fn):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return [w for w in got if "numpy" not in str(w.message).lower()]


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator pass-through warning")
@pytest.mark.parametrize("entry", ["direct", "config", "from_config", "ctx_manager"])
def test_warning_points_at_the_callers_line(entry):
    """The pass-through warning is attributed to this file, whichever entry point built the engine."""
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
    calls = {
        "direct": lambda: OffloadActivations(),
        "config": lambda: OffloadActivations(config=OffloadConfig()),
        "from_config": lambda: OffloadActivations.from_config(OffloadConfig(), model=model),
        "ctx_manager": lambda: get_act_offloading_ctx_manager(model),
    }
    got = _warned(calls[entry])
    assert got and all(w.filename == __file__ for w in got), [(w.filename, str(w.message)[:60]) for w in got]


def test_no_head_warning_points_at_the_callers_line_and_can_be_silenced():
    """get_act_offloading_ctx_manager's no-head warning names this file; warn_if_no_head=False silences it."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    got = _warned(lambda: get_act_offloading_ctx_manager(model, device="cpu"))
    assert len(got) == 1 and got[0].filename == __file__ and "output head" in str(got[0].message)
    assert _warned(lambda: get_act_offloading_ctx_manager(model, device="cpu", warn_if_no_head=False)) == []


def test_unused_exclusion_warning_points_at_the_users_backward():
    """The end-of-backward warning (raised from an autograd callback) is attributed to this file."""
    model = MLP()
    ctx = OffloadActivations(device="cpu", min_offload_size=0)
    ctx.exclude(nn.Linear(2, 2))  # never runs

    def step():
        with ctx:
            out = model(make_inputs("mlp")[0]).sum()
        out.backward()

    got = _warned(step)
    assert len(got) == 1 and got[0].filename == __file__, [(w.filename, str(w.message)[:80]) for w in got]


def test_tier_settings_round_trip_and_refusals(tmp_path):
    """The host tiers' settings survive yaml; a disk_dir that is a file is refused naming the setting."""
    cfg = OffloadConfig(host_budget_bytes=0, pageable_budget_bytes=None, disk_dir=tmp_path,
                        disk_budget_bytes=1 << 30, disk_queue_bytes=1 << 20, on_host_budget="raise")
    assert cfg.disk_dir == str(tmp_path)  # a path is normalised to a string: yaml-safe
    assert OffloadConfig.from_yaml(cfg.to_yaml()) == cfg
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match="disk_dir=.*exists as a file"):
        OffloadConfig(disk_dir=str(f))


# -- upper bounds of the size settings (every int setting is a size or a count) -----------------

SIZE_SETTINGS = ("max_fwd_stash_size", "min_offload_size", "max_inflight_bytes", "device_budget_bytes", "prefetch_bytes",
                 "host_budget_bytes", "pageable_budget_bytes", "disk_budget_bytes", "disk_queue_bytes",
                 "disk_readahead_bytes", "max_records")


def test_size_settings_are_every_int_setting():
    """The bound below covers every int setting: a new size setting must be added to SIZE_SETTINGS."""
    ints = {f.name for f in dataclasses.fields(OffloadConfig) if "int" in str(f.type) or "Bytes" in str(f.type)}
    assert ints == set(SIZE_SETTINGS)


@pytest.mark.parametrize("name", SIZE_SETTINGS)
@pytest.mark.parametrize("via", VIAS)
def test_size_beyond_what_the_engine_can_hold_is_refused_at_build(name, via):
    """A size no engine can honour (10**30: more than a 64-bit size, what torch, the C++ hook and the
    record ring hold) is refused when the config is built, naming the setting, the value and the bound."""
    value = 10**30
    with pytest.raises(ValueError) as ei:
        _build(via, name, value)
    msg = str(ei.value)
    assert name in msg and repr(value) in msg and str(SIZE_LIMIT) in msg, msg
    with pytest.raises(ValueError, match=name):
        OffloadConfig(**{name: SIZE_LIMIT + 1})


@pytest.mark.parametrize("name", SIZE_SETTINGS)
def test_largest_accepted_size_is_honoured(name, request):
    """Each size setting at its largest accepted value builds an engine that trains bitwise for two
    steps (the C++ hook by default, the Python hook in the --python-hooks pass): the bound is one the code honours."""
    cfg = OffloadConfig(**{"device": "cpu", "min_offload_size": 0, name: SIZE_LIMIT})
    model = MLP()
    twin = twin_of(model)
    ctx = OffloadActivations(config=cfg)
    inputs = make_inputs("mlp")
    for _ in range(2):
        run_step(model, inputs, ctx)
        run_step(twin, inputs)
    assert_same_grads(model, twin)
    s = ctx.ledger.summary()
    assert s["packed_count"] > 0 and s["steps"] == 2, s
