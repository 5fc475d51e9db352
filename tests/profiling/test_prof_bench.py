"""bench.profiler_overhead runs end to end and writes its result file (no timing assertions)."""

from __future__ import annotations

import json

from bench import profiler_overhead


def test_profiler_overhead_smoke(tmp_path, capsys):
    """Every variant runs the requested steps and lands in the JSON and the printed table."""
    out = tmp_path / "overhead.json"
    profiler_overhead.main(["--steps", "2", "--warmup", "0", "--dim", "32", "--seq", "16",
                            "--skip", "module_stats", "--threads", "0", "--out", str(out)])
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["variants"]}
    assert set(rows) == {"none", "packed", "rss", "packed+rss", "memprofiler_collecting", "memprofiler_done",
                         "engine", "engine+packed", "engine+memprofiler"}
    assert all(r["n"] == 2 and len(r["seconds"]) == 2 for r in rows.values())
    assert rows["engine+packed"]["baseline"] == "engine" and rows["none"]["overhead_pct"] == 0.0
    assert "memprofiler_collecting" in capsys.readouterr().out
