"""The documentation site builds strictly (broken links, missing references and mkdocstrings errors
fail), its configuration reference is generated from OffloadConfig, and the README stays short."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offload import OffloadConfig

ROOT = Path(__file__).resolve().parents[1]


def _field_docs() -> dict[str, str]:
    """Each OffloadConfig field's docstring (the string literal under it in offload/config.py)."""
    src = inspect.getsource(OffloadConfig)
    docs = {}
    for f in dataclasses.fields(OffloadConfig):
        m = re.search(rf"^\s+{f.name}: .*\n\s+\"\"\"(.+?)\"\"\"", src, flags=re.M | re.S)
        assert m, f"OffloadConfig.{f.name} has no docstring: the configuration reference would be empty"
        docs[f.name] = m.group(1)
    return docs


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """`mkdocs build --strict` into a temporary folder (nothing written into the checkout)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_docs_build_strictly(site):
    """Every page of the nav is built, including the pages other work fills in."""
    for page in ("index.html", "configuration/index.html", "emulator/index.html", "planner/index.html",
                 "host-tiers/index.html", "integrations/trl/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page


def test_configuration_reference_is_generated_from_the_fields(site):
    """Every OffloadConfig field appears on the configuration page with its own docstring's words."""
    html = (site / "configuration" / "index.html").read_text()
    text = re.sub(r"<[^>]+>", "", html)
    for name, doc in _field_docs().items():
        assert name in text, name
        words = " ".join(doc.split()[:4])
        assert words in " ".join(text.split()).replace("&quot;", '"'), (name, words)


def test_readme_is_short_and_docs_hold_the_depth():
    """The README is a first screen and links (a few hundred words); the depth lives in docs/."""
    readme = len((ROOT / "README.md").read_text().split())
    docs = sum(len(p.read_text().split()) for p in (ROOT / "docs").rglob("*.md"))
    assert readme <= 900 and docs >= 5 * readme, (readme, docs)
