"""Shared fixtures and the GPU skip rule."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--native-hooks", action="store_true", default=False,
        help="run every engine built in the tests with native_hooks=True (the C++ pack hook, built now) by default",
    )
    parser.addoption(
        "--python-hooks", action="store_true", default=False,
        help="run every engine built in the tests with native_hooks=False (the Python hook) by default",
    )


def hooks_option(config) -> str:
    """The pack hook the tests' engines get by default: "native" (--native-hooks), "python" (--python-hooks)
    or "auto" (the engine's own default: the C++ hook, built before the first test where it builds)."""
    native, python = config.getoption("--native-hooks"), config.getoption("--python-hooks")
    if native and python:
        raise pytest.UsageError("--native-hooks and --python-hooks exclude each other")
    return "native" if native else "python" if python else "auto"


@pytest.fixture(scope="session")
def hooks(request) -> str:
    """The run's ``hooks_option``."""
    return hooks_option(request.config)


@pytest.fixture(autouse=True, scope="session")
def _native_hooks_default(request):
    """--native-hooks / --python-hooks: the engine's and OffloadConfig's default for native_hooks becomes True
    / False, so the whole suite runs through the C++ pack hook / the Python hook (tests that pass
    native_hooks explicitly keep theirs). Without either, the default stays "auto", and the extension is
    loaded (built if needed, ~20 s once) before the first test, so that every engine of the run uses the same
    hook rather than whichever a background build had reached (NOTE [ Native build ])."""
    from offload import OffloadActivations, OffloadConfig, _native

    option = hooks_option(request.config)
    if option == "auto":
        _native.available()  # where it cannot be built, "auto" is the Python hook for the whole run
        yield
        return
    if option == "native":
        _native.load()  # fail here, once, when it cannot be built
    value = option == "native"
    patched = [OffloadActivations.__init__, OffloadConfig.__init__]
    field = OffloadConfig.__dataclass_fields__["native_hooks"]  # what dataclasses.fields() reports
    default = field.default
    for f in patched:
        f.__kwdefaults__["native_hooks"] = value
    field.default = value
    try:
        yield
    finally:
        for f in patched:
            f.__kwdefaults__["native_hooks"] = default
        field.default = default


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_run.sh on a GPU machine)")
    for item in items:
        # The marker itself: item.keywords also holds the names of the item's parents, so a
        # checkout in a folder named "gpu" would otherwise skip every test.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh git repository holding this checkout's tracked files (as a clone would), committed:
    what a job run from a fresh clone sees (one per test module)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = Path(__file__).resolve().parents[1]
    try:
        files = _git(root, "ls-files", "-z").split("\0")
    except subprocess.CalledProcessError:
        pytest.skip("not a git checkout")
    dst = tmp_path_factory.mktemp("clone")
    for f in filter(None, files):
        src = root / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    _git(dst, "init", "-q")
    _git(dst, "add", "-A")
    _git(dst, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "snapshot")
    assert _git(dst, "status", "--porcelain") == ""
    return dst
