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


def _public_namespaces() -> list[str]:
    """What users import: every package the wheel ships (pyproject.toml's ``[tool.setuptools] packages``)
    that is not private and has ``__all__``, and the framework modules of ``offload.integrations`` /
    ``offload.compat`` (imported by name, as their packages' docstrings say)."""
    import importlib
    import pkgutil
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    names = [p for p in packages if not any(part.startswith("_") for part in p.split("."))]
    for parent in ("offload.integrations", "offload.compat"):
        names += [m.name for m in pkgutil.iter_modules(importlib.import_module(parent).__path__, f"{parent}.")
                  if not m.name.rsplit(".", 1)[1].startswith("_")]
    out = []
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # an optional framework missing here: the page documents it statically
            out.append(name)
            continue
        if getattr(mod, "__all__", None) is not None:
            out.append(name)
    return out


def test_api_reference_lists_every_public_name(site):
    """Every name in a public package's ``__all__`` (the engine, the planner, the config, the errors,
    the callbacks, the profilers...) has its entry on the generated API reference page."""
    import ast
    import importlib

    html = (site / "reference" / "index.html").read_text()
    ids = set(re.findall(r'id="([^"]+)"', html))
    missing = []
    for ns in _public_namespaces():
        try:
            names = importlib.import_module(ns).__all__
        except ImportError:  # an optional framework missing here: read __all__ from the source
            path = ROOT / ns.replace(".", "/").replace("offload/profiling", "profiling")
            tree = ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text())
            names = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                         and "__all__" in ast.unparse(n))
        shown = "profiling" if ns == "offload.profiling" else ns  # griffe reads the folder (docs/reference.md)
        missing += [f"{ns}.{n}" for n in names if not n.startswith("__") and f"{shown}.{n}" not in ids]
    assert not missing, f"public names missing from docs/reference.md: {missing}"
    for name in ("offload.plan", "offload.Plan", "offload.OffloadConfig", "offload.OffloadVerifyError",
                 "offload.AttachHandle", "offload.register_model", "offload.integrations.hf.OffloadCallback",
                 "offload.integrations.lightning.OffloadCallback"):
        assert name in ids, name
