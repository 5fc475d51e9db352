"""A disk-tier run directory: its name, its lock (whose run it is), its life (open, open again after
``close()``, disowned in a forked child) and deleting it, including the directories that dead
processes left behind. See NOTE [ Disk tier ] in ``offload/disk.py``.

NOTE [ Disk run life ]
- After ``close``: the next ``reserve`` opens a new run directory
  (logged); records of the closed run raise ``DiskTierError`` if loaded. So
  an engine used again (a second ``trainer.train()``) keeps its disk tier.
- A run directory deleted under the store (a tmp cleaner, a script's
  ``rm -rf`` of ``disk_dir``) is made again at the same path, with a new
  lock and any parents it needs, when a reserve or a write finds it gone:
  counted (``stats()["recreated"]``), logged each time, one warning that
  says so. Copies not yet written stay in host memory (nothing is lost);
  records whose files went with the directory raise ``DiskTierError`` when
  backward loads them (never a wrong gradient). ``file_bytes`` counts
  those files until their handles go. If it cannot be made again, copies
  fall through as below, and it is tried again once per step.
- A ``disk_dir`` that cannot be written (read-only, no permission) is not
  an error: the store opens without a run directory, warns once naming
  ``disk_dir``, refuses every reserve (counted in ``refused_bytes``: the
  copy falls through to ``on_host_budget``) and tries again once per step.
- Only the process that made a run directory deletes anything in it. A child
  made by ``fork()`` (``os.fork``, a fork-started pool) disowns the parent's
  run at once (``os.register_at_fork``): no finalizer, no file deletion, its
  copy of the lock closed, fresh locks and no threads; its own copies open a
  run directory of its own. The finalizer also checks the pid, for forks
  made outside Python. (``multiprocessing`` children, DataLoader workers
  among them, end with ``os._exit`` and never drop the engine, so before
  this only a forked child that exited normally, running ``atexit`` and so
  the finalizer, or that freed or closed the engine, deleted the files.)
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from typing import Any, Callable

from ._disk_record import DiskRecord, DiskTierError
from .errors import _internal_assert
from .pool import HostPool

__all__ = ["RUN_PREFIX", "LOCK_NAME", "RunLife", "make_dirs", "remove_dirs", "open_run_dir", "delete_run",
           "clean_stale_runs"]

logger = logging.getLogger("offload.disk")

RUN_PREFIX = "offload-"
"""Run directories are named ``offload-<host>-<pid>-<token>``."""
LOCK_NAME = "LOCK"


def _lock_text() -> str:
    return (f"pid={os.getpid()}\nhost={socket.gethostname()}\nstarted={time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
            f"command={' '.join(sys.argv)[:400]}\n")


def make_dirs(path: str) -> list[str]:
    """Create ``path`` and its missing parents; the directories created, outermost first (what
    ``remove_dirs`` may remove again, and nothing else). Nothing is left created on failure."""
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        up = os.path.dirname(p)
        if up == p:
            break
        p = up
    created: list[str] = []
    try:
        for d in reversed(missing):
            os.mkdir(d)
            created.append(d)
    except OSError:
        remove_dirs(created)
        raise
    return created


def remove_dirs(created: list[str]) -> None:
    """Remove the directories ``make_dirs`` created, innermost first, while they are empty (a
    directory something else put files in stays, and so do the ones above it)."""
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            return


def open_run_dir(parent: str, token: bytes) -> tuple[str, list[int]]:
    """Make this run's directory in ``parent`` and lock it: (its path, [the lock's descriptor]).

    The lock is held as long as the descriptor is open (``delete_run`` closes it); the
    descriptor is not inherited across ``exec``. Nothing is left on failure."""
    run_dir = os.path.join(parent, f"{RUN_PREFIX}{socket.gethostname()}-{os.getpid()}-{token.hex()[:8]}")
    os.mkdir(run_dir)
    try:
        # Locked through a read-only descriptor (a file open for writing would keep the file
        # system from turning read-only), written once through another.
        lock_path = os.path.join(run_dir, LOCK_NAME)
        lock_fd = [os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o644)]
        try:
            fcntl.flock(lock_fd[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            with open(lock_path, "w") as f:
                f.write(_lock_text())
        except BaseException:
            os.close(lock_fd[0])
            raise
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return run_dir, lock_fd


def delete_run(run_dir: str, lock_fd: list[int], created: list[str], pid: int) -> None:
    """Delete a run directory (and the parents made for it) and drop its lock (finalizer: holds no
    reference to the store). Only in process ``pid``, the run's owner: a child made by ``fork()``
    (a subprocess helper, a fork-started pool) shares the directory but never deletes it; it only
    closes its copy of the lock's descriptor (the lock belongs to the parent's copy too)."""
    if os.getpid() == pid:
        shutil.rmtree(run_dir, ignore_errors=True)
        remove_dirs(created)
    if lock_fd and lock_fd[0] >= 0:
        try:
            os.close(lock_fd[0])
        except OSError:
            pass
        lock_fd[0] = -1


def clean_stale_runs(parent: str) -> list[str]:
    """Delete the run directories in ``parent`` left by dead processes of this host; their names."""
    host = socket.gethostname()
    gone = []
    try:
        names = os.listdir(parent)
    except OSError:
        return gone
    for name in names:
        if not name.startswith(RUN_PREFIX + host + "-"):
            continue
        path = os.path.join(parent, name)
        lock = os.path.join(path, LOCK_NAME)
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            # No lock file: a run that died between mkdir and creating its lock.
            if os.path.isdir(path) and time.time() - os.path.getmtime(path) > 60:
                shutil.rmtree(path, ignore_errors=True)
                gone.append(name)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: a live run
            try:
                whose = os.pread(fd, 1024, 0).decode(errors="replace").replace("\n", " ").strip()
            except OSError:
                whose = "?"
            shutil.rmtree(path, ignore_errors=True)
            gone.append(name)
            logger.warning("offload disk tier: deleted %s, left by a process that died (%s)", path, whose)
        finally:
            os.close(fd)
    return gone


class RunLife:
    """The run-directory half of ``DiskStore`` (a mixin: the store's ``__init__`` sets the state)."""

    parent: str
    queue_bytes: int
    writers: int
    readers: int
    _pin: bool
    _cv: threading.Condition
    _closed: bool
    _retry: bool
    _run: tuple[int, int]
    _lock_fd: list[int]
    _created: list[str]
    _finalizer: weakref.finalize | None
    _threads: list[threading.Thread]
    _warn_once: Callable[[str, int, str], None]
    _start_threads: Callable[[], None]
    _staging: HostPool

    @property
    def grow_gate(self) -> Callable[[int], bool] | None:
        """Asked before staging takes new host memory (a new staging chunk, a one-off buffer): the RAM
        ceiling, set by ``HostTiers``; staging the store already holds never asks (NOTE [ Host tiers ])."""
        return self._staging.grow_gate

    @grow_gate.setter
    def grow_gate(self, gate: Callable[[int], bool] | None) -> None:
        self._staging.grow_gate = gate

    def _open(self) -> bool:
        """Make a run directory (and missing parents of it), lock it and start the threads; False,
        with one warning, when ``disk_dir`` cannot be written (copies then fall through)."""
        try:
            created = make_dirs(self.parent)
            try:
                stale = clean_stale_runs(self.parent)
                token = uuid.uuid4().bytes
                run_dir, lock_fd = open_run_dir(self.parent, token)
            except BaseException:
                remove_dirs(created)
                raise
        except OSError as e:
            self._retry = False
            self._warn_once("open", 0, f"{os.strerror(e.errno) if e.errno else e}")
            return False
        pid = os.getpid()
        with self._cv:
            self.stale_cleaned, self.token, self.run_dir, self._lock_fd = stale, token, run_dir, lock_fd
            self._created = created
            self.opens += 1
            self._run = (pid, self.opens)
            self._closed = False
        self._finalizer = weakref.finalize(self, delete_run, run_dir, lock_fd, created, pid)
        self._start_threads()
        return True

    def _reopen(self) -> bool:
        """Open a closed store again (a reserve after close(), or the first in a forked child)."""
        with self._open_lock:
            if not self._closed:
                return True
            if not self._retry:
                return False
            was = self.run_dir
            if not self._open():
                return False
        logger.info("offload disk tier: opened %s for new copies (the run directory %s was closed%s)",
                    self.run_dir, was, "" if was is None or self._run[0] == self._forked_from else
                    " by ctx.close(); graphs built before it cannot be backpropagated through")
        return True

    def _renew_if_gone(self) -> bool:
        """Make the open run directory again if it was deleted under the store (NOTE [ Disk run
        life ]): True when it exists now. Called after a file operation failed, never per copy."""
        if self._closed or os.path.isdir(self.run_dir or ""):
            return not self._closed
        with self._open_lock:
            if self._closed:
                return False
            if os.path.isdir(self.run_dir):
                return True  # another thread made it again
            if not self._retry:
                return False  # failed this step already
            try:
                created = make_dirs(self.parent)
                try:
                    run_dir, lock_fd = open_run_dir(self.parent, self.token)
                except BaseException:
                    remove_dirs(created)
                    raise
            except OSError as e:
                self._retry = False
                cause = os.strerror(e.errno) if e.errno else str(e)
                self._warn_once("renew_failed", 0, cause)
                return False
            with self._cv:
                old_fd, self._lock_fd[0] = self._lock_fd[0], lock_fd[0]  # the finalizer's list
                # Parents made now go with the run too (outermost first, as make_dirs lists them).
                self._created[:] = sorted({*self._created, *created}, key=lambda d: d.count(os.sep))
                self.recreated += 1
                n = self.recreated
            os.close(old_fd)  # the lock of the deleted LOCK file
        _internal_assert(run_dir == self.run_dir, "a run directory made again under another name")
        logger.info("offload disk tier: the run directory %s was deleted while in use; made it again "
                    "(%d time(s))", run_dir, n)
        self._warn_once("renew", 0, "")
        return True

    _forked_from = 0

    def _after_fork_in_child(self) -> None:
        """In a child made by ``fork()``: the run directory is the parent's. Forget it without
        deleting anything (no finalizer, no file deletion here); the child's own copies open a run
        directory of their own. The threads did not survive the fork and the locks may be held."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if not self._closed and self._lock_fd[0] >= 0:
            os.close(self._lock_fd[0])  # the child's copy only: the parent's copy keeps the lock
        self._lock_fd = [-1]
        self._cv = threading.Condition()
        self._open_lock = threading.Lock()
        self._queue, self._reads, self._threads = deque(), deque(), []
        gate, self._staging = self.grow_gate, HostPool(pin=self._pin, capacity_bytes=self.queue_bytes)
        self._staging.grow_gate = gate
        self._pending_bytes = self._prefetched = self._live_file_bytes = self._files = 0
        self._forked_from = self._run[0]
        self._closed, self._retry = True, True


    def _closed_error(self, rec: DiskRecord | None = None) -> DiskTierError:
        if rec is not None and rec.run[0] != os.getpid():
            return DiskTierError(
                f"offload disk tier: a saved tensor's file {rec.path!r} belongs to process {rec.run[0]}, "
                f"which built this graph before this process (pid {os.getpid()}) was forked from it; the "
                "child neither reads nor deletes the parent's files. Run backward in the process that "
                "ran the forward.")
        return DiskTierError(
            f"offload disk tier: {os.path.dirname(rec.path) if rec is not None else self.run_dir!r} was "
            "closed (ctx.close()) and its files deleted, so a backward through a graph built before "
            "close() cannot get its saved tensors back. Run every backward before ctx.close()."
        )

_STORES: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Every live store of this process (what a forked child must disown)."""


def _disown_after_fork() -> None:
    for store in list(_STORES):
        store._after_fork_in_child()


os.register_at_fork(after_in_child=_disown_after_fork)
