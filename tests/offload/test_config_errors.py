"""Errors a person can act on: "did you mean" for unknown names wherever settings arrive, sizes with
units, and callbacks and job sections checked when they are built."""

from __future__ import annotations

import pytest
import torch

from offload import OffloadActivations, OffloadConfig
from offload.config import SIZE_FIELDS
from offload.integrations.torchtitan import config_from_section

TYPOS = [("min_ofload_size", "min_offload_size"), ("devcie", "device"), ("host_budget", "host_budget_bytes"),
         ("use_pinned_memory", "use_pin_memory"), ("prefetch_byte", "prefetch_bytes")]


def _callbacks():
    out = []
    for module in ("offload.integrations.hf", "offload.integrations.lightning"):
        try:
            out.append(pytest.importorskip(module).OffloadCallback)
        except pytest.skip.Exception:
            pass
    return out


@pytest.mark.parametrize("typo,meant", TYPOS)
def test_unknown_keyword_suggests_the_setting(typo, meant):
    """A misspelt keyword names the class the user called, the typo and the closest setting, wherever
    it arrives: the engine, the config, a dict, the callbacks (not OffloadConfig.__init__ for them)."""
    calls = {"OffloadActivations": lambda: OffloadActivations(**{typo: 0}),
             "OffloadConfig": lambda: OffloadConfig(**{typo: 0})}
    for cb in _callbacks():
        calls[f"OffloadCallback ({cb.__module__})"] = lambda cb=cb: cb(**{typo: 0})
    for owner, call in calls.items():
        with pytest.raises(TypeError) as ei:
            call()
        msg = str(ei.value)
        assert msg.startswith(owner.split()[0] + ":"), msg
        assert f"{typo!r} (did you mean {meant!r}?)" in msg, msg
    with pytest.raises(ValueError, match=rf"{typo!r} \(did you mean {meant!r}\?\)"):
        OffloadConfig.from_dict({typo: 0})
    with pytest.raises(ValueError, match=rf"{typo!r} \(did you mean {meant!r}\?\)"):
        OffloadConfig.from_yaml(f"{typo}: 0\n")


def test_keyword_check_keeps_defaults_patchable_and_positional_rule():
    """The check wraps __init__ without hiding its keyword defaults (shared dict) or the positional rule."""
    assert OffloadActivations.__init__.__kwdefaults__ is OffloadActivations.__init__.__wrapped__.__kwdefaults__
    with pytest.raises(TypeError, match="positional"):
        OffloadActivations(True, True, 5)


@pytest.mark.parametrize("text,nbytes", [
    ("2GiB", 2 << 30), ("512MB", 512 * 10**6), ("4 KiB", 4096), ("1.5GiB", 3 << 29), ("100B", 100),
    ("2gb", 2 * 10**9), ("1e3KB", 10**6),
])
def test_sizes_take_units(text, nbytes):
    """Every size setting takes a string with a unit (binary KiB/MiB/GiB, decimal KB/MB/GB), from code
    and from yaml, and stores the int."""
    for name in SIZE_FIELDS:
        assert getattr(OffloadConfig(**{name: text}), name) == nbytes
        assert getattr(OffloadConfig.from_yaml(f"{name}: {text}\n"), name) == nbytes


def test_integral_floats_are_sizes_even_from_yaml():
    """2e9 (also as yaml reads it: YAML 1.1 would make it a string) and 1024.0 are sizes; 1.5 bytes is not."""
    assert OffloadConfig(host_budget_bytes=2e9).host_budget_bytes == 2_000_000_000
    cfg = OffloadConfig.from_yaml("host_budget_bytes: 2e9\nmin_offload_size: 1024.0\n")
    assert (cfg.host_budget_bytes, cfg.min_offload_size) == (2_000_000_000, 1024)
    assert isinstance(cfg.host_budget_bytes, int)
    assert OffloadConfig.from_yaml(cfg.to_yaml()) == cfg
    with pytest.raises(ValueError, match="prefetch_bytes=1.5 is invalid: 1.5 is not a whole number of bytes"):
        OffloadConfig(prefetch_bytes=1.5)


@pytest.mark.parametrize("bad", ["16G", "2 GiBs", "GiB", "-1GiB", "1.0000001KB"])
def test_bad_size_strings_name_the_setting_and_the_forms(bad):
    """An ambiguous or unknown unit, no number, a negative size or a fraction of a byte fails, naming the
    setting (every form a size may take: tests/offload/test_sizes.py)."""
    with pytest.raises((TypeError, ValueError), match=r"host_budget_bytes="):
        OffloadConfig(host_budget_bytes=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_callbacks_refuse_a_missing_device_when_built(device):
    """OffloadCallback(device="cuda") on a CPU machine fails when built (not at train begin), naming the
    callback, the value and the fixes."""
    callbacks = _callbacks()
    if not callbacks:
        pytest.skip("neither transformers nor lightning is installed")
    for cb in callbacks:
        with pytest.raises(ValueError) as ei:
            cb(device=device)
        msg = str(ei.value)
        assert msg.startswith("OffloadCallback:") and repr(device) in msg and "'cpu'" in msg and "None" in msg


def test_torchtitan_section_needs_mode():
    """A section without `mode:` is an error naming the fix, not a silent `none`; typos get a suggestion."""
    with pytest.raises(ValueError, match=r"no 'mode'.*mode: full"):
        config_from_section({"min_offload_size": 4096})
    with pytest.raises(ValueError, match=r"'mdoe' \(did you mean 'mode'\?\)"):
        config_from_section({"mdoe": "full"})
    mode, cfg = config_from_section({"mode": "full", "host_budget_bytes": "16GiB"})
    assert mode == "full" and cfg.host_budget_bytes == 16 << 30
    assert config_from_section({"mode": "none"})[0] == "none"


@pytest.mark.parametrize("args", [("cpu",), (True, "cpu"), (torch.device("cpu"),)])
def test_a_device_given_positionally_suggests_device_by_name(args):
    """OffloadActivations("cpu") (a device where use_pin_memory or use_streams goes) says to pass
    device="cpu" by name; a string that is no device gets the plain bool advice."""
    with pytest.raises(TypeError) as ei:
        OffloadActivations(*args)
    assert "device='cpu'" in str(ei.value) and "use_pin_memory and use_streams" in str(ei.value), str(ei.value)
    with pytest.raises(TypeError) as ei:
        OffloadActivations("yes")
    assert "device=" not in str(ei.value) and "Pass a bool" in str(ei.value)


@pytest.mark.parametrize("bad", [{"dedupe": "yes"}, {"on_host_budget": "drop"}, {"max_fwd_stash_size": 0},
                                 {"host_budget_bytes": "12XB"}, {"virtual_memory_safe_pct": 150.0}])
def test_errors_name_what_the_user_called(bad):
    """A bad setting passed to OffloadActivations(...) is reported as OffloadActivations's, the same setting in
    OffloadConfig(...) as OffloadConfig's (the engine builds a config from its arguments: its errors said
    "OffloadConfig:" for a call that never named one)."""
    (name, value), = bad.items()
    with pytest.raises((TypeError, ValueError)) as engine_err:
        OffloadActivations(device="cpu", **bad)
    with pytest.raises((TypeError, ValueError)) as config_err:
        OffloadConfig(**bad)
    assert str(engine_err.value).startswith(f"OffloadActivations: {name}={value!r} is invalid"), engine_err.value
    assert str(config_err.value).startswith(f"OffloadConfig: {name}={value!r} is invalid"), config_err.value
    assert str(engine_err.value).partition(": ")[2] == str(config_err.value).partition(": ")[2]
