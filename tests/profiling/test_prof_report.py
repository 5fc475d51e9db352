"""Readable output helpers: bytes, tables, PNG plots, JSON/YAML, missing matplotlib."""

from __future__ import annotations

import sys

import pytest
import yaml

from profiling import ProfilingError, format_bytes, format_table, plot_series, write_json, write_yaml


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
