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
