"""The framework integrations are optional: without the framework, importing one says what to install."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize("module,framework,extra", [
    ("offload.integrations.hf", "transformers", "offload[hf]"),
    ("offload.integrations.lightning", "lightning", "offload[lightning]"),
])
def test_missing_framework_names_the_extra(monkeypatch, module, framework, extra):
    """ImportError names the missing framework and the pip extra that installs it."""
    for name in list(sys.modules):
        if name == module or name == framework or name.startswith(framework + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, framework, None)  # `import framework` now fails
    with pytest.raises(ImportError) as ei:
        importlib.import_module(module)
    assert f"pip install {extra}" in str(ei.value) and framework in str(ei.value)


def test_importing_offload_imports_no_framework():
    """`import offload` (and offload.integrations) loads neither transformers nor lightning."""
    import os
    import subprocess
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    code = ("import sys, offload, offload.integrations, offload.compat.trl, offload.compat.torchtune; "
            "print(sorted(m for m in ('transformers', 'lightning', 'trl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": root, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
