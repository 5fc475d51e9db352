"""The distribution holds the two libraries and nothing else, installs into a fresh venv, and promises
complete extras; the libraries never reach up into the repo's tools (bench, examples, scripts, tests)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from _venvs import site_packages, venv_on_this_environment

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("offload", "profiling")
"""The repository's library folders; profiling/ installs as offload.profiling (a distribution named
`profiling` exists on the package index: the wheel must not own that top-level name)."""
INSTALLED_AS = {"offload": "offload", "profiling": "offload/profiling"}
REPO_TOOLS = ("bench", "examples", "scripts", "tests")
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _imported_top_levels(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_libraries_never_import_the_repo_tools():
    """No module under offload/ or profiling/ imports bench, examples, scripts or tests (anywhere in the
    file, lazily included): an installed wheel has none of them."""
    offenders = [f"{p.relative_to(ROOT)} imports {sorted(_imported_top_levels(p) & set(REPO_TOOLS))}"
                 for lib in LIBRARIES for p in sorted((ROOT / lib).rglob("*.py"))
                 if _imported_top_levels(p) & set(REPO_TOOLS)]
    assert not offenders, offenders


def test_nothing_imports_a_top_level_profiling():
    """Every module of the repo imports the profilers as offload.profiling: a top-level `profiling` is
    another distribution's name, and from a checkout it would be a second copy of every class."""
    offenders = [f for f in subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                                           text=True, check=False).stdout.split()
                 if "profiling" in _imported_top_levels(ROOT / f)]
    assert not offenders, offenders


def test_a_checkout_maps_its_profiling_folder_to_offload_profiling(tmp_path):
    """From a checkout that is only on sys.path (no install, no .pth files processed), offload.profiling is
    the profiling/ folder beside offload/, its modules included; a top-level `import profiling` there is
    refused with the name to use."""
    import site

    code = (f"import sys; sys.path[:0] = {[str(ROOT), *site.getsitepackages()]!r}\n"
            "import offload.profiling, offload.profiling.packed\n"
            "print(offload.profiling.__file__); print(offload.profiling.packed.__file__)\n"
            "try:\n    import profiling\nexcept ImportError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    init, packed, refusal = proc.stdout.strip().splitlines()[-3:]
    assert (Path(init), Path(packed)) == (ROOT / "profiling" / "__init__.py", ROOT / "profiling" / "packed.py")
    assert "offload.profiling" in refusal and "'profiling'" in refusal, refusal


def _dist_name(project: dict, spec: str) -> str:
    return re.split(r"[<>=\[ ;!~]", spec, maxsplit=1)[0].lower()


def test_extras_are_complete():
    """Each extra brings what its feature imports (hf: transformers + accelerate, which Trainer needs),
    and the test extra installs every other extra's packages, so CI tests what the extras promise."""
    project = _project()
    extras = {k: {_dist_name(project, s) for s in v} for k, v in project["optional-dependencies"].items()}
    assert {"hf", "trl", "lightning", "qlora", "ilp", "docs", "test", "native", "plot", "bench"} <= set(extras)
    assert {"numpy", "scipy", "matplotlib"} <= extras["bench"]  # bench.results' statistics and the plot
    assert {"transformers", "accelerate"} <= extras["hf"]
    assert {"trl", "transformers", "accelerate"} <= extras["trl"]
    assert "lightning" in extras["lightning"] and "torchao" in extras["qlora"]
    assert {"mkdocs-material", "mkdocstrings"} <= extras["docs"]
    others = set().union(*(v for k, v in extras.items() if k != "test"))
    assert others <= extras["test"], sorted(others - extras["test"])
    assert not any(_dist_name(project, d) == "torch" and d.strip() == "torch" for d in project["dependencies"])
    # The C++ pack hook, the default where it builds, is built with ninja: a dependency, not only an extra
    # (without it every install ran the Python hook).
    assert "ninja" in {_dist_name(project, d) for d in project["dependencies"]}


def test_metadata_is_set():
    """Version, license (and its file), project URLs and classifiers are declared."""
    project = _project()
    assert re.fullmatch(r"\d+\.\d+\.\d+(\w+\d*)?", project["version"])
    assert project["license"] and all((ROOT / f).is_file() for f in project["license-files"])
    assert {"Homepage", "Documentation", "Issues"} <= set(project["urls"])
    assert any(c.startswith("Programming Language :: Python :: 3") for c in project["classifiers"])


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """A wheel and an sdist built by `python -m build` from a copy of the tracked files (so the build
    writes nothing into this checkout), without build isolation (offline, the installed setuptools)."""
    pytest.importorskip("build")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (wheel,), (sdist,) = out.glob("*.whl"), out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def _tracked(folder: str) -> list[str]:
    files = subprocess.run(["git", "ls-files", "-z", folder], cwd=ROOT, capture_output=True, text=True,
                           check=False).stdout.split("\0")
    return [f for f in files if f]


def test_wheel_holds_only_the_libraries(dists):
    """The wheel's only top-level package is offload (profiling/ inside it, as offload/profiling/; no
    top-level `profiling`), with the typed markers, the C++ source native_hooks builds and every tracked
    module of both folders (the package list in pyproject.toml is explicit); none of the repo tools."""
    names = zipfile.ZipFile(dists["wheel"]).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"offload"}, sorted(tops)
    assert {"offload/py.typed", "offload/profiling/py.typed", "offload/_native/pack.cpp"} <= set(names)
    modules = {f.replace(lib, INSTALLED_AS[lib], 1) for lib in LIBRARIES for f in _tracked(lib) if f.endswith(".py")}
    assert modules, "git ls-files found no modules"
    assert modules <= set(names), sorted(modules - set(names))
    metadata = zipfile.ZipFile(dists["wheel"]).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "Provides-Extra: hf" in metadata and "License-Expression: BSD-3-Clause" in metadata


def test_sdist_holds_only_the_libraries(dists):
    """The sdist ships the libraries, pyproject, README and LICENSE; none of the repo tools."""
    with tarfile.open(dists["sdist"]) as tar:
        parts = {n.split("/")[1] for n in tar.getnames() if "/" in n}
    assert set(LIBRARIES) <= parts and {"pyproject.toml", "README.md", "LICENSE"} <= parts
    assert not parts & set(REPO_TOOLS), sorted(parts & set(REPO_TOOLS))


def test_a_venv_made_inside_a_venv_sees_the_outer_venvs_packages(tmp_path):
    """Run from inside a venv (as most people install), the tests' own venv sees a package installed only
    in that venv (as psutil was, where the base interpreter had none), not only the base's packages."""
    outer = venv_on_this_environment(tmp_path / "outer")
    (site_packages(outer) / "only_in_the_outer_venv.py").write_text("")
    code = ("import sys, pathlib; sys.path.insert(0, sys.argv[1]); from _venvs import venv_on_this_environment\n"
            "py = venv_on_this_environment(pathlib.Path(sys.argv[2]))\n"
            "import subprocess; sys.exit(subprocess.run([str(py), '-c', "
            "'import only_in_the_outer_venv, psutil, torch']).returncode)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(outer), "-c", code, str(Path(__file__).parent), str(tmp_path / "nested")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_dist_installs_and_imports_in_a_fresh_venv(dists, kind, tmp_path):
    """Installed into a fresh venv that sees this environment's packages (torch, the build tools, pip: a
    venv's own bundled setuptools may predate the license field; --no-deps: offline), offload and
    offload.profiling import from the venv, not from this checkout, and run a step with the engine."""
    py = venv_on_this_environment(tmp_path / "venv")
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                          str(dists[kind])], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-3000:]
    code = ("import offload, offload.profiling as profiling, torch, pathlib, sys\n"
            "site = pathlib.Path(sys.prefix).resolve()\n"
            "for m in (offload, profiling, profiling.packed):\n"
            "    assert site in pathlib.Path(m.__file__).resolve().parents, m.__file__\n"
            "net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))\n"
            "with offload.OffloadActivations(device='cpu', min_offload_size=0) as ctx:\n"
            "    loss = net(torch.randn(4, 8)).sum()\n"
            "loss.backward()\n"
            "assert ctx.ledger.summary()['offloaded_bytes'] > 0\n"
            "print(offload.__version__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(py), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == _project()["version"]
