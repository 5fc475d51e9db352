"""Readable output helpers: bytes, tables, PNG plots, JSON/YAML, missing matplotlib."""

from __future__ import annotations

import sys

import pytest
import yaml

from offload.profiling import ProfilingError, format_bytes, format_table, plot_series, write_json, write_yaml


def test_format_bytes_and_table():
    """Byte formatting picks units; table columns align with bytes rendered in the byte columns."""
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30, "MiB") == "3072.00 MiB"
    assert format_bytes(12, "B") == "12 B"
    with pytest.raises(ValueError, match="unit='TB'"):
        format_bytes(1, "TB")
    t = format_table([{"name": "a", "n": 2048}, {"name": "bb", "n": 1}], ["name", "n"], title="T",
                     byte_columns=["n"])
    lines = t.splitlines()
    assert lines[0] == "T" and lines[1].split() == ["name", "n"]
    assert lines[3].split() == ["a", "2.00", "KiB"] and lines[4].split() == ["bb", "1", "B"]


def test_plot_json_yaml(tmp_path):
    """PNG plots are real PNGs; YAML/JSON hold plain data (sets become sorted lists)."""
    png = plot_series({"rss": [1 << 20, 2 << 20]}, tmp_path / "p.png", x=["a", "b"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    data = {"k": {"x": 1, "s": {3, 1}}, "f": 1.5}
    assert yaml.safe_load(write_yaml(data, tmp_path / "d.yaml").read_text()) == {"k": {"x": 1, "s": [1, 3]}, "f": 1.5}
    assert write_json(data, tmp_path / "d.json").read_text().startswith("{")


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    """Without matplotlib a plot request says how to install the optional extra."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ProfilingError, match=r"pip install 'offload\[plot\]'"):
        plot_series({"a": [1]}, tmp_path / "p.png")


def test_one_json_conversion_is_strict_and_keeps_derived_metrics():
    """profiling's to_plain is the bench's to_jsonable too: NaN/inf become null (strict JSON), properties kept."""
    import dataclasses
    import json

    import torch

    from bench.results import to_jsonable
    from offload.profiling._util import to_plain

    assert to_jsonable is to_plain

    @dataclasses.dataclass
    class R:
        a: float
        b: tuple

        @property
        def twice(self) -> float:
            return 2 * self.a

    data = to_plain({"r": R(float("nan"), (1.0, float("inf"))), "x": torch.tensor(3.5), "d": torch.float16})
    text = json.dumps(data, allow_nan=False)  # raises on NaN: the strict-JSON promise
    assert json.loads(text) == {"r": {"a": None, "b": [1.0, None], "twice": None}, "x": 3.5, "d": "torch.float16"}


def test_planner_tables_render_through_the_one_renderer():
    """bench.plan's tables are tabulate's github tables (aligned columns, '|' in a cell cannot split a row)."""
    from bench.plan import format_max_seq

    text = format_max_seq({"workload": {"run_id": "w"}, "device": "cpu", "budget_bytes": 2**20, "method": "m",
                           "rows": [{"arm": "a|b", "max_seq": 128, "capped": True, "peak_bytes": 2**19, "note": "n"}]})
    table = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len(table) == 3 and len({len(ln) for ln in table}) == 1, text  # header, rule, one row, aligned
    assert all(ln.count("|") == 5 for ln in table), text
    assert "0.50 MiB" in text and "128+" in text
