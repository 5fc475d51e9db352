"""The pack hook in C++ (``OffloadConfig.native_hooks``: "auto", the default, or True).

``pack.cpp`` decides and records, for a plain tensor, exactly what
``OffloadActivations._pack`` (``offload/_packing.py``) would: a kept one all in C++; for an offload
candidate it calls the engine's own offload step (``_offload``, ``_log_offload``) with the facts it
read. It hands every other tensor (subclasses, anything unusual, leaves whose owner must be asked,
packs on another thread than the one that entered the engine, every pack an observer would see) to
``_pack`` before doing anything. The Python hook stays the
reference: ``tests/offload/test_native.py`` compares the two record by record.

Built with ``torch.utils.cpp_extension.load`` (a C++ compiler and ``ninja``, a dependency whose binary
the build finds off ``PATH`` too, ``_ninja_on_path``; about 20 s
once, then cached under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, as
``offload_native_pack_<torch version>_<hash of this checkout's pack.cpp>``: one build per torch
version, source and checkout, so two checkouts never rebuild over each other).

NOTE [ Native build ]
Nothing blocks silently on the build:

- ``native_hooks="auto"`` (``auto()``): an extension already built for this source loads in a
  fraction of a second (waited for, at most ``AUTO_WAIT_S``); otherwise it builds on a background
  thread while the Python hook runs, and engines switch to it at their next ``with`` once it is
  there (the two hooks decide and record the same, so nothing but CPU time changes). One log line
  (INFO) says so, and one says why when it cannot be built (no warning: nobody asked for it).
- ``native_hooks=True`` (``load()``): the constructor builds it, after one log line (WARNING: the
  process waits ~20 s), and raises when it cannot be built.

A build killed midway (Ctrl-C, an OOM kill, a job's time limit) leaves torch's ``lock`` file in
the build directory, on which every later ``cpp_extension.load`` of that name waits forever. Every
build here runs holding an advisory lock of its own (``fcntl.flock`` on ``offload-build.lock``
beside torch's), which the operating system drops when its process dies: a process holding it
knows that no live build holds torch's lock, so it removes a ``lock`` it finds there (one log
line). While another live process builds, it waits for it (a log line first), at most
``LOCK_WAIT_S``. Without ``fcntl`` (Windows) a ``lock`` older than ``LOCK_WAIT_S`` counts as stale.
A process that *ends* during its build (a short script under "auto") leaves the same ``lock`` and the
same free advisory lock, but its ``ninja`` and compiler run on: before removing the ``lock``, a build
waits for any process still working in the directory (``_wait_for_orphans``; seen through ``/proc``,
so on Linux only), so two builds never write one directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("pack.cpp").resolve()
"""The source, by its real path: the extension's name (``_build_name``) and torch's build file both hold a
path, so an install reached through links (a link farm, a linked site-packages) loads the same build as its
target, instead of rebuilding it once per path that reaches it (torch's build file names the source, and
ninja rebuilds when a command changed)."""
_NAME = "offload_native_pack"
AUTO_WAIT_S = 5.0
"""``auto()`` waits at most this long for an extension already built for this source to load."""
LOCK_WAIT_S = 600.0
"""How long a build waits for another live process's build of the same extension (then gives up)."""
_lock = threading.Lock()
"""Held while loading or building (``load``)."""
_start_lock = threading.Lock()
"""Held while starting the background thread (never while building: ``auto`` must not wait on a build)."""
_module: ModuleType | None = None
_failure: str | None = None
_background: threading.Thread | None = None
_announced: threading.Thread | None = None
"""The background thread ``auto`` last logged about (one line per build)."""


class NativeUnavailable(RuntimeError):
    """The C++ pack hook could not be built or loaded here (the message says why)."""


def load(*, announce: bool = True) -> ModuleType:
    """The built extension, configured; builds it on the first call. The caller waits for the build (~20 s
    once), or for another process's build of it: with ``announce`` a warning says so first (else a log line:
    the background build, or a caller that said so itself). Raises ``NativeUnavailable``."""
    global _module, _failure
    with _lock:
        if _module is not None:
            return _module
        if _failure is not None:
            raise NativeUnavailable(_failure)
        try:
            _module = _build(announce)
        except Exception as e:  # a missing compiler or ninja, a header mismatch, ...
            _failure = _reason(e)
            _log.info("offload: the native pack hook is unavailable: %s", _failure)
            raise NativeUnavailable(_failure) from e
        return _module


def for_engine(engine: Any, *, ready_only: bool = False) -> ModuleType | None:
    """The extension whose hook ``engine``'s ``__enter__`` pushes; None: the engine's Python ``_pack``.

    By ``engine.config.native_hooks``: True, the extension (built now), or ``OffloadError`` saying why
    not; "auto", ``auto()`` (with ``ready_only``: only if it is loaded already, no build started); False,
    None. An engine whose class overrides ``_pack`` gets its own ``_pack`` under "auto" (the C++ hook would
    keep tensors without calling it)."""
    native_hooks = engine.config.native_hooks
    if native_hooks is True:
        try:
            return load()
        except NativeUnavailable as e:
            from ..errors import OffloadError

            raise OffloadError(
                f"OffloadActivations: native_hooks=True, but the C++ pack hook cannot be built here ({e}). "
                "Install a C++ compiler and ninja (pip install ninja), or pass native_hooks=False (the Python "
                "hook: the same decisions, at more CPU time per saved tensor) or leave the default, 'auto' "
                "(the C++ hook wherever it builds, the Python hook elsewhere)."
            ) from e
    if native_hooks != "auto" or _overrides_pack(type(engine)):
        return None
    return _module if ready_only else auto()


def _overrides_pack(cls: type) -> bool:
    from .._packing import _Packing

    return getattr(cls, "_pack", None) is not _Packing._pack


def loaded() -> ModuleType | None:
    """The extension if it is loaded in this process, else None (never builds or waits)."""
    return _module


def auto() -> ModuleType | None:
    """``native_hooks="auto"``: the extension now, if loaded or already built for this source (then
    loaded, waiting at most ``AUTO_WAIT_S``); else None, with a build started in the background
    (NOTE [ Native build ]). Never raises for a build that fails: the Python hook runs instead."""
    if _module is not None or _failure is not None:
        return _module
    built = is_built()
    thread = _start()
    if built:
        thread.join(AUTO_WAIT_S)
        if _module is not None or _failure is not None:
            return _module
    global _announced
    if thread is not _announced:
        _announced = thread
        _log.info("offload: %s the native pack hook %s in the background (first use: ~20 s); the Python "
                  "hook runs until it is ready, then engines switch to it at their next `with` (same "
                  "decisions and records)", "loading" if built else "building", _build_name())
    return None


def _start() -> threading.Thread:
    """The background thread that loads or builds the extension (started once per process)."""
    global _background
    with _start_lock:
        if _background is None:
            _background = threading.Thread(target=_load_quietly, name="offload-native-build", daemon=True)
            _background.start()
        return _background


def _load_quietly() -> None:
    t0 = time.monotonic()
    try:
        load(announce=False)
    except NativeUnavailable as e:
        _log.info("offload: the native pack hook cannot be built here (%s); the Python hook runs (same "
                  "decisions, more CPU time per saved tensor). Install a C++ compiler and ninja (pip install "
                  "ninja) for it, or pass native_hooks=False not to try.", e)
        return
    _log.info("offload: the native pack hook is ready (%.1f s); engines use it from their next `with`",
              time.monotonic() - t0)


def _reset_after_fork() -> None:
    """A forked child has no build thread (and the lock may have been held by it at the fork)."""
    global _lock, _start_lock, _background, _announced
    _lock, _start_lock = threading.Lock(), threading.Lock()
    if _module is None:
        _background = _announced = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _reason(e: BaseException) -> str:
    """One line: the compiler's first ``error:`` line when there is one (torch's build error carries
    ninja's whole output, which ends in ninja's own line), else the message's first line."""
    texts = [str(x) for x in (e, e.__cause__) if x is not None]
    lines = [ln.strip() for text in texts for ln in text.splitlines() if ln.strip()]
    first_error = next((ln for ln in lines if "error:" in ln and not ln.startswith("ninja")), None)
    return f"{type(e).__name__}: {first_error or (lines[0] if lines else repr(e))}"


def available() -> bool:
    """Whether ``load()`` succeeds (building the extension if needed)."""
    try:
        load()
    except NativeUnavailable:
        return False
    return True


def _build_name() -> str:
    """The extension's name: per torch version (torch's cache is keyed by Python version and accelerator,
    not by torch version, and the module reads torch's C++ structures), and per source and checkout
    (torch rebuilds a name whose source changed, so two checkouts sharing the cache would rebuild over
    each other at every switch)."""
    import torch

    digest = hashlib.sha256(_SOURCE.read_bytes() + str(_SOURCE).encode()).hexdigest()[:12]
    return f"{_NAME}_{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}_{digest}"


def build_dir() -> Path:
    """Where the extension is built and cached (made if missing)."""
    from .._torch_private import extension_build_dir

    return Path(extension_build_dir(_build_name()))


def is_built() -> bool:
    """Whether this source's extension is in the cache, newer than its source (a load, not a build)."""
    try:
        d = build_dir()
        so = next(d.glob(f"{_build_name()}*.so"), None) or next(d.glob(f"{_build_name()}*.pyd"), None)
        return so is not None and so.stat().st_mtime >= _SOURCE.stat().st_mtime
    except OSError:
        return False


def _build(announce: bool) -> ModuleType:
    from torch.utils import cpp_extension

    name, where = _build_name(), build_dir()
    say = _warn if announce else _log.info
    if not is_built():
        say(f"offload: building the native pack hook {name} from {_SOURCE} (~20 s, once per torch version and "
            "source; native_hooks='auto', the default, builds it in the background instead of waiting)")
    with build_lock(where, say=say), _ninja_on_path():
        module = cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=["-O2"],
                                    build_directory=str(where), is_python_module=True, verbose=False)
    module.configure(_constants())
    from .. import modules

    modules.attach_native(module)  # module tracking's C wrapper (NOTE [ Module tracking in C ])
    return module


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """``PATH`` with the ``ninja`` package's binary on it while torch builds, where no ``ninja`` is found on
    it: the package (a dependency) installs its binary beside the interpreter's scripts, which are not on
    ``PATH`` for a virtual environment's Python run without activating it, and torch's build runs ``ninja``
    from ``PATH``. Appended, not prepended (that folder holds a ``python`` too: no other name on ``PATH``
    resolves differently meanwhile), and restored after (it is the process's environment, and the build
    may run on a background thread); a no-op where ``ninja`` is found."""
    import shutil

    bin_dir = None
    if shutil.which("ninja") is None:
        try:
            import ninja

            bin_dir = getattr(ninja, "BIN_DIR", None)
        except ImportError:
            pass
    if not bin_dir or shutil.which("ninja", path=bin_dir) is None:
        yield  # torch's own error then names what is missing
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(p for p in (before, bin_dir) if p)
    _log.info("offload: building with the ninja package's binary in %s (not on PATH)", bin_dir)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


_TORCH_LOCK = "lock"
"""The file torch's ``cpp_extension`` (its ``FileBaton``) creates in the build directory while it builds."""
_OUR_LOCK = "offload-build.lock"


@contextlib.contextmanager
def build_lock(where: Path, wait_s: float | None = None, say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the build directory ``where`` for one build: an ``fcntl.flock`` (dropped by the operating
    system when the holder dies), waiting for a live holder at most ``wait_s`` (default ``LOCK_WAIT_S``;
    ``say`` tells the caller first, a warning by default); then torch's ``lock`` file found there is
    stale: removed (NOTE [ Native build ])."""
    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    torch_lock = where / _TORCH_LOCK
    where.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no advisory locks (Windows): only an old lock counts as stale
        fcntl = None
    with open(where / _OUR_LOCK, "a+") as f:
        held = fcntl is not None and _flock(fcntl, f, where, wait_s, say or _warn)
        try:
            if held:
                f.seek(0)
                f.truncate()
                f.write(str(os.getpid()))
                f.flush()
                if torch_lock.exists():  # every build holds the flock: no live build of ours holds this
                    _wait_for_orphans(where, wait_s, say or _warn)
                    _remove_stale(torch_lock, "no live build holds it")
            else:
                with contextlib.suppress(OSError):
                    if time.time() - torch_lock.stat().st_mtime > wait_s:
                        _remove_stale(torch_lock, f"older than {wait_s:.0f} s")
            yield
        finally:
            if held:
                fcntl.flock(f, fcntl.LOCK_UN)


def _flock(fcntl: Any, f: Any, where: Path, wait_s: float, say: Callable[[str], None]) -> bool:
    """Take the advisory lock on ``f``, waiting for a live holder at most ``wait_s`` (then raise);
    False where the file system has no such locks."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    except OSError:  # a file system without advisory locks
        return False
    f.seek(0)
    holder = f.read().strip() or "?"
    say(f"offload: waiting for another process (pid {holder}) that is building the native pack hook in {where} "
        f"(at most {wait_s:.0f} s)")

    def taken() -> bool:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    if _poll(taken, wait_s):
        return True
    raise NativeUnavailable(f"another process (pid {holder}) has been building the native pack hook in {where} "
                            f"for over {wait_s:.0f} s; let it finish, or end it and retry")


def _poll(done: Callable[[], bool], wait_s: float) -> bool:
    """Ask ``done`` every 0.1 s until it says True (then True) or ``wait_s`` has passed (then False)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if done():
            return True
    return False


def _orphans(where: Path) -> list[int]:
    """Pids of the processes working in ``where``: the ``ninja`` and compiler of a build whose process ended
    before they did. torch runs ``ninja`` there as a child process, which outlives a Python process that
    exits mid-build ("auto" builds on a daemon thread: a short script ends during its build), and the
    advisory lock ends with that process. Read from ``/proc`` (Linux); elsewhere none can be seen."""
    proc, me, out = Path("/proc"), os.getpid(), []
    if not proc.is_dir():
        return out
    target = os.path.realpath(where)
    for p in proc.iterdir():
        if p.name.isdigit() and int(p.name) != me:
            with contextlib.suppress(OSError):
                if os.readlink(p / "cwd") == target:
                    out.append(int(p.name))
    return out


def _wait_for_orphans(where: Path, wait_s: float, say: Callable[[str], None]) -> None:
    """Before torch's stale ``lock`` is removed: wait for an earlier build's orphaned ``ninja`` and compiler
    (``_orphans``) to finish, at most ``wait_s`` (then raise), so two builds never write one directory."""
    pids = _orphans(where)
    if not pids:
        return
    say(f"offload: waiting for the compiler of an earlier build of the native pack hook (pids {pids}, whose "
        f"process ended before its build did) to finish in {where} (at most {wait_s:.0f} s)")
    if not _poll(lambda: not _orphans(where), wait_s) and (pids := _orphans(where)):  # (still there at the end)
        raise NativeUnavailable(f"the compiler of an earlier build (pids {pids}) has been running in {where} for "
                                f"over {wait_s:.0f} s; let it finish, or end it and retry")


def _warn(message: str) -> None:
    from .._warn import warn_user

    warn_user(message)


def _remove_stale(path: Path, why: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        _log.warning("offload: removed %s, left by a build of the native pack hook that was killed or whose "
                     "process ended before it (%s)", path, why)


def _record_fields(cls: type) -> tuple[tuple[str, Any], ...] | None:
    """``(name, default)`` of each field of the dataclass ``cls``, in order (None for a field without a
    plain default); None when a field has a default factory (the C++ hook then calls the class)."""
    import dataclasses

    out = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            return None
        out.append((f.name, None if f.default is dataclasses.MISSING else f.default))
    return tuple(out)


def _constants() -> dict[str, Any]:
    import torch
    from torch import nn

    from .. import _handles, _observers, _packing, _spans, ledger, modules, policy

    return {
        "tensor_type": torch.Tensor, "parameter_type": nn.Parameter,
        "parameter": policy.PARAMETER, "buffer": policy.BUFFER,
        "excluded_region": policy.EXCLUDED_REGION, "too_small": policy.TOO_SMALL,
        "in_backward": policy.IN_BACKWARD, "after_head": policy.AFTER_HEAD,
        "kept": ledger.KEPT, "offloaded": ledger.OFFLOADED, "is_param": policy._is_param,
        "module_names": modules._names, "module_generation": modules._generation,
        "current_module_name": modules.current_module_name,
        "observer_count": _observers._observer_count, "observer_tls": _observers._tls,
        "step_type": _handles._Step,
        "byte_span": _spans.byte_span,
        "pack_record": ledger.PackRecord, "pack_record_fields": _record_fields(ledger.PackRecord),
        "dtype_names": policy._DTYPE_NAMES, "dtype_name": policy.dtype_name,
        "log_offload": _packing._log_offload,
    }
