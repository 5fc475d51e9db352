"""The packages as the wheel installs them, linked from this checkout (stdlib only): what a reader has on the
path after ``pip install``, without bench/ or tests/ (tests/test_readme.py runs the docs' blocks in it;
tests/offload/test_native.py checks that an install reached through links shares the checkout's build)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wheel_packages() -> dict[str, Path]:
    """Each package the wheel ships (pyproject.toml's ``[tool.setuptools] packages``) and its folder here
    (``package-dir`` maps ``offload.profiling`` to the repo's ``profiling/``)."""
    import tomllib  # (Python 3.11+: imported when asked, so that importing this module works on 3.10)

    st = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = st.get("package-dir", {})
    return {p: ROOT / dirs.get(p, p.replace(".", "/")) for p in st["packages"]}


def linked_install(tmp: Path) -> Path:
    """``tmp / "site-packages"``, laid out as the wheel installs, each file a link to this checkout's."""
    site = tmp / "site-packages"
    for pkg, src in sorted(wheel_packages().items()):
        dest = site.joinpath(*pkg.split("."))
        dest.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file():
                (dest / f.name).symlink_to(f)
    return site
