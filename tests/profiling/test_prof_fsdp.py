"""MemProfiler's FSDP2 report from a one-process gloo ``fully_shard`` model on CPU (in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_fsdp_worker.py")


def run_worker(out: Path, device: str = "cpu") -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(WORKER), str(out), device], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.distributed
def test_fsdp2_report_on_gloo_cpu(tmp_path):
    """The collected call writes the FSDP log and exact sharded-param/input peaks into the snapshot."""
    res = run_worker(tmp_path)
    assert res["rank"] == 0
    assert {"fsdp_mem_rank_0_training_step_2.log", "rank_0_memory_stats.yaml",
            "rank_0_memory_stats.pickle"} <= set(res["files"])
    log = (tmp_path / "fsdp_mem_rank_0_training_step_2.log").read_text()
    assert log.startswith("Iteration 2 training_step Peak FSDP memory stats")
    for needle in ("Sharded Param", "Unsharded Param", "OptState", "Modulewise FSDP memory stats",
                   "FSDPToyLlama.layers.0", "Peak Backward"):
        assert needle in log, needle
    end = yaml.safe_load((tmp_path / "rank_0_memory_stats.yaml").read_text())["0.training_step.2.end"]
    # world size 1: the shard is the whole parameter set; AdamW keeps two moments per parameter
    assert end["fsdp.peak.cpu.sharded_param"] == res["param_bytes"]
    assert end["fsdp.peak.cpu.optstate"] >= 2 * res["param_bytes"]
    assert end["fsdp.peak.cpu.inputs"] == res["tokens_storage_bytes"]  # track_inputs was given the tokens
    assert end["fsdp.peak.cpu.total"] > end["fsdp.peak.cpu.sharded_param"]
    assert end["npp_diff"] > 0
