"""examples/profile_offload_head.py runs on CPU in a subprocess and shows the head exclusion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_profile_offload_head_example(tmp_path):
    """Head offloaded in one run and kept (excluded_region) in the other; both write MemProfiler stats."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "profile_offload_head.py"), "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith("head_")}
    assert float(rows["head_offloaded"][1]) > 0 and float(rows["head_offloaded"][2]) == 0
    assert float(rows["head_excluded"][1]) == 0 and float(rows["head_excluded"][2]) > 0
    ends = {}
    for run in ("head_offloaded", "head_excluded"):
        data = yaml.safe_load((tmp_path / run / "rank_0_memory_stats.yaml").read_text())
        assert set(data) == {"0.training_step.2.start", "0.training_step.2.end"}
        ends[run] = data["0.training_step.2.end"]
        assert ends[run]["offload.offloaded_bytes"] > 0 and ends[run]["npp_diff"] > 0
    assert ends["head_excluded"]["offload.kept_by_reason.excluded_region"] > 0
    assert "offload.kept_by_reason.excluded_region" not in ends["head_offloaded"]
    # the same forward either way: the saved bytes do not depend on where they go
    assert ends["head_excluded"]["npp_diff"] == ends["head_offloaded"]["npp_diff"]
    # every profiler the README names left its artifacts (issue 9: the example uses them all)
    for run in ("head_offloaded", "head_excluded"):
        for name in ("rank_0_memory_stats.png", "rank_0_module_bytes.png", "tracker_steps.png",
                     "tracker_modules.png", "packed.json", "rss.json"):
            assert (tmp_path / run / name).stat().st_size > 0, (run, name)
        packed = json.loads((tmp_path / run / "packed.json").read_text())
        assert packed["steps"] == 3 and packed["offloaded_bytes"] > 0
        assert any(k.startswith("ToyLlama.layers.0") for k in json.loads((tmp_path / run / "rss.json").read_text())["modules"])
    assert (tmp_path / "trace" / "rank0.2.pt.trace.json").exists()
    info = json.loads((tmp_path / "ilp_module_info.json").read_text())
    assert info["mod_stats"][0]["fqn"] == "ToyLlama" and info["mod_stats"][0]["param_per_module"] > 0
    assert "torch auto-AC baseline" in proc.stdout
