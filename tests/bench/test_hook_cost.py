"""`python -m bench.hook_cost` at a tiny size: every variant measured, the JSON has the documented structure."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from bench import hook_cost


def test_hook_cost_tiny_run_structure(tmp_path):
    """A tiny run writes per-pack/unpack numbers for every variant, the ratios and the emulated stream sweep."""
    out = tmp_path / "hook_cost.json"
    res = hook_cost.main(["--layers", "6", "--width", "32", "--rounds", "2", "--warmup", "1",
                          "--no-instructions", "--stream-in-flight", "0,8", "--gc-steps", "2", "--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk["cpu_time"] == json.loads(json.dumps(res["cpu_time"]))
    cpu = on_disk["cpu_time"]
    assert cpu["saves_per_step"] == 6 * 3  # sin saves x; mul saves sin(x) and w
    missing = on_disk["missing_variants"]
    assert set(missing) <= set(hook_cost.OPTIONAL) and all(missing.values())  # each absence says why
    assert "trl_keep" not in missing  # TRL is in the test extra: its real keep path is measured
    assert set(cpu["variants"]) == set(hook_cost.VARIANTS) - set(missing)
    for name, row in cpu["variants"].items():
        keys = ("per_module_call_ns",) if name in hook_cost._PER_MODULE_CALL else ("per_pack_ns", "per_unpack_ns")
        for k in keys:
            assert set(row[k]) == {"median", "p25", "p75"} and all(math.isfinite(v) for v in row[k].values())
    assert "per_pack_net_of_module_hooks_ns" in cpu["variants"]["ours_offload"]
    assert set(cpu["ratios_per_pack"]) == set(hook_cost.RATIOS)
    assert set(on_disk["stream_emulated"]["per_pack_ns_by_in_flight"]) == {"0", "8"}
    assert set(on_disk["variants"]) == set(hook_cost.VARIANTS)  # each variant described in the JSON
    assert "instructions" not in on_disk
    gcs = on_disk["gc"]
    assert gcs["steps"] == 2 and gcs["tracked_objects"] > 0
    assert set(gcs["variants"]) == {v for v in hook_cost._GC_VARIANTS if v not in missing}
    for row in gcs["variants"].values():
        assert set(row["collections"]) == {"0", "1", "2"} and row["gc_ns_per_pack_total"] >= 0


@pytest.mark.parametrize("make", ["_torchtune_keep_hooks", "_torchtune_real_hooks", "_trl_keep_hooks"])
def test_keep_peers_round_trip(make):
    """Each peer's keep hooks (the torchtune-style restatement, torchtune's and TRL's own classes when
    installed) give back the very tensors that were saved: the gradients equal a hook-free twin's."""
    try:
        hooks = getattr(hook_cost, make)()
    except ImportError as e:
        pytest.skip(str(e))
    for name in ("torchtune", "torchtune.modules", "torchtune.utils", "torchao.dtypes.nf4tensor"):
        # The torchtune loader's stand-ins (modules without a file) are gone again.
        assert name not in sys.modules or getattr(sys.modules[name], "__file__", None), name
    model, x, saves = hook_cost._setup(4, 8)
    with hooks:
        out = model(x)
    out.sum().backward()
    ref_model, ref_x, _ = hook_cost._setup(4, 8)
    ref_model(ref_x).sum().backward()
    assert saves == 12
    got = [p.grad for p in model.parameters()] + [x.grad]
    want = [p.grad for p in ref_model.parameters()] + [ref_x.grad]
    assert all(torch.equal(p, q) for p, q in zip(got, want, strict=True))


def test_parse_annotate_reads_inclusive_costs_and_the_native_hooks_calls_into_python():
    """The breakdown's parser: a function's own "*" line (its inclusive cost, whatever the spacing of the
    percentage), and of the C++ hook's callees only its calls into Python; a function listed twice
    counts once (the larger)."""
    text = "\n".join([
        "--------------------------------------------------------------------------------",
        " 40,872,391 (64.58%)  >   ???:(anonymous namespace)::pack_impl(_object*, _object*) (5,010x) [x.so]",
        "",
        "  4,297,228 ( 7.54%)  *  ???:torch::autograd::SavedVariable::get_default_hooks() [libtorch_cpu.so]",
        "    911,214 ( 1.44%)  >   ???:PyGILState_Ensure (6,012x) [libtorch_python.so]",
        "",
        " 40,872,391 (64.58%)  *  ???:(anonymous namespace)::pack_impl(_object*, _object*) [x.so]",
        " 31,458,234 (49.71%)  >   /tmp/Python-3.11.7/Objects/call.c:PyObject_VectorcallMethod (3,340x)",
        "  2,057,152 ( 3.25%)  >   /tmp/Python-3.11.7/Objects/call.c:PyObject_Vectorcall'2 (3,335x)",
        "    100,000 ( 0.16%)  >   /tmp/Python-3.11.7/Objects/call.c:PyObject_VectorcallMethod (1x)",
        "",
        " 40,000,000 (60.00%)  *  python.c:(anonymous namespace)::pack_impl(_object*, _object*) [x.so]",
        " 30,000,000 (45.00%)  >   /tmp/Python-3.11.7/Objects/call.c:PyObject_VectorcallMethod (3,340x)",
        "",
        "  9,999,999 (15.00%)  *  ???:some_other_function [y.so]",
        "  8,888,888 (14.00%)  >   /tmp/Python-3.11.7/Objects/call.c:PyObject_VectorcallMethod (10x)",
    ])
    assert hook_cost.parse_annotate(text) == {"torch_get_default_hooks": 4_297_228, "native_pack": 40_872_391,
                                              "native_pack_python": 31_558_234}
    assert hook_cost.parse_annotate("") == {"torch_get_default_hooks": 0, "native_pack": 0, "native_pack_python": 0}
