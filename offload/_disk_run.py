"""A disk-tier run directory: its name, its lock (whose run it is), and deleting it, including
the directories that dead processes left behind. See NOTE [ Disk tier ] in ``offload/disk.py``."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import sys
import time

__all__ = ["RUN_PREFIX", "LOCK_NAME", "open_run_dir", "delete_run", "clean_stale_runs"]

logger = logging.getLogger("offload.disk")

RUN_PREFIX = "offload-"
"""Run directories are named ``offload-<host>-<pid>-<token>``."""
LOCK_NAME = "LOCK"


def _lock_text() -> str:
    return (f"pid={os.getpid()}\nhost={socket.gethostname()}\nstarted={time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
            f"command={' '.join(sys.argv)[:400]}\n")


def open_run_dir(parent: str, token: bytes) -> tuple[str, list[int]]:
    """Make this run's directory in ``parent`` and lock it: (its path, [the lock's descriptor]).

    The lock is held as long as the descriptor is open (``delete_run`` closes it)."""
    run_dir = os.path.join(parent, f"{RUN_PREFIX}{socket.gethostname()}-{os.getpid()}-{token.hex()[:8]}")
    os.mkdir(run_dir)
    # Locked through a read-only descriptor (a file open for writing would keep the file
    # system from turning read-only), written once through another.
    lock_path = os.path.join(run_dir, LOCK_NAME)
    lock_fd = [os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o644)]
    fcntl.flock(lock_fd[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock_path, "w") as f:
        f.write(_lock_text())
    return run_dir, lock_fd


def delete_run(run_dir: str, lock_fd: list[int]) -> None:
    """Delete a run directory and drop its lock (finalizer: holds no reference to the store)."""
    shutil.rmtree(run_dir, ignore_errors=True)
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
