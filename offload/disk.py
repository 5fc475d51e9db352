"""The disk tier: saved-tensor bytes in files of one run directory, on background threads.

NOTE [ Disk tier ]
- One *run directory* per store, ``<disk_dir>/offload-<host>-<pid>-<token>``,
  holding one small ``LOCK`` file (whose text says whose run it is: pid,
  host, start time, command) and one file per record, nothing else. The
  lock is an ``flock`` held for the store's life; the kernel drops it when
  the process dies, however it dies (SIGKILL included). So at start, every
  ``offload-*`` directory of this host in ``disk_dir`` whose lock can be
  taken belongs to a dead process and is deleted (logged with its lock's
  text); live runs (other ranks, other engines) keep their lock and are left
  alone.
- ``reserve`` (compute thread) creates the record's file and allocates its
  bytes (``posix_fallocate``), so a full disk or an unwritable directory is
  known *before* the bytes are copied: the request falls through to the next
  tier, with one warning naming the directory and the bytes. It hands out a
  host *staging* buffer for the device-to-host copy. Staging buffers come
  from a private pool capped at ``queue_bytes``: a reserve waits while the
  bytes not yet written would exceed it (the stated bound on host RAM that
  pending writes hold; one request bigger than the bound gets a one-off
  buffer of its own, after the queue has drained).
- ``submit`` queues the record for a writer thread (a small pool), which
  waits for the copy, computes a CRC-32, writes a header (magic, this
  store's token, the record's sequence number, its size, the CRC) and the
  bytes, then gives the staging buffer back. A write that still fails keeps
  the bytes in host memory (counted as ``memory_bytes``): nothing is lost.
- ``prefetch`` reads a record ahead on a reader thread (backward calls it in
  the order prefetch uses); ``load`` returns the bytes, waiting for a
  pending write or read if needed (timed as exposed wait). Every read checks
  the file's size and header against the record and the payload against its
  CRC: a truncated, overwritten or foreign file raises ``DiskTierError``,
  never a wrong gradient.
- ``give`` (the record's handle died: Rule 1) cancels a pending write and
  deletes the file; ``close`` deletes every file, the lock and the run
  directory; a finalizer does the same at interpreter exit or when the store
  is collected.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import struct
import sys
import threading
import time
import uuid
import weakref
import zlib
from collections import deque
from typing import Any, Callable

import torch

from ._warn import warn_user
from .errors import OffloadError
from .pool import HostPool

__all__ = ["DiskStore", "DiskRecord", "DiskTierError", "RUN_PREFIX", "LOCK_NAME"]

logger = logging.getLogger("offload.disk")

RUN_PREFIX = "offload-"
"""Run directories are named ``offload-<host>-<pid>-<token>``."""
LOCK_NAME = "LOCK"
_MAGIC = b"OFLDTNS1"
_HEADER = struct.Struct("<8s16sQQI4x")  # magic, store token, sequence, nbytes, crc32
HEADER_BYTES = _HEADER.size
_GiB = 1 << 30


class DiskTierError(OffloadError):
    """A disk-tier file does not hold what was written (truncated, overwritten, foreign)."""


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        data = data[n:]
        offset += n


def _read_all(fd: int, into: memoryview, offset: int) -> int:
    got = 0
    while got < len(into):
        n = os.preadv(fd, [into[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


def _lock_text() -> str:
    return (f"pid={os.getpid()}\nhost={socket.gethostname()}\nstarted={time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
            f"command={' '.join(sys.argv)[:400]}\n")


def _cleanup_run(run_dir: str, lock_fd: list[int]) -> None:
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


class DiskRecord:
    """One tensor's bytes in the disk tier (quacks like a ``HostBuffer`` while staged)."""

    __slots__ = ("seq", "nbytes", "path", "tensor", "pooled_staging", "state", "crc", "copy", "read",
                 "read_bytes", "memory", "cache", "__weakref__")
    pinned = False
    pooled = False

    def __init__(self, seq: int, nbytes: int, path: str) -> None:
        self.seq = seq
        self.nbytes = nbytes
        self.path = path
        self.tensor: Any = None
        """The staging buffer (a HostBuffer's flat uint8 tensor) until written; None after."""
        self.pooled_staging: Any = None
        self.state = "staged"  # staged -> queued -> on_disk | in_memory | released
        self.crc = 0
        self.copy: Any = None
        self.read: Any = None  # [done event, tensor or exception] of a read ahead
        self.read_bytes = 0
        self.memory: torch.Tensor | None = None  # the bytes, if a write failed
        self.cache = None  # HostBuffer.cache compatibility (never reused)


class DiskStore:
    """Files for tensor bytes under ``parent`` (see NOTE [ Disk tier ]). Thread-safe."""

    writers = 2
    """Writer threads."""
    readers = 1
    """Reader threads."""

    def __init__(self, parent: str, *, budget_bytes: int | None = None, queue_bytes: int = 256 << 20,
                 readahead_bytes: int = 256 << 20, pin: bool = False,
                 on_time: Callable[[str, float, int], None] | None = None) -> None:
        parent = os.path.abspath(os.fspath(parent))
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise ValueError(
                f"offload disk tier: disk_dir={parent!r} exists and is not a directory. Pass a "
                "directory (it is created if missing; each engine makes its own run directory in it)."
            )
        self.parent = parent
        self.budget_bytes = budget_bytes
        self.queue_bytes = queue_bytes
        self.readahead_bytes = readahead_bytes
        self._on_time = on_time
        self.token = uuid.uuid4().bytes
        self._created_parent = not os.path.exists(parent)
        os.makedirs(parent, exist_ok=True)
        self.stale_cleaned = clean_stale_runs(parent)
        self.run_dir = os.path.join(
            parent, f"{RUN_PREFIX}{socket.gethostname()}-{os.getpid()}-{self.token.hex()[:8]}")
        os.mkdir(self.run_dir)
        # Locked through a read-only descriptor (a file open for writing would keep the file
        # system from turning read-only), written once through another.
        lock_path = os.path.join(self.run_dir, LOCK_NAME)
        self._lock_fd = [os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o644)]
        fcntl.flock(self._lock_fd[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
        with open(lock_path, "w") as f:
            f.write(_lock_text())
        self._finalizer = weakref.finalize(self, _cleanup_run, self.run_dir, self._lock_fd)
        self._staging = HostPool(pin=pin, capacity_bytes=queue_bytes)
        self._cv = threading.Condition()
        self._queue: deque[DiskRecord] = deque()
        self._reads: deque[tuple[DiskRecord, list]] = deque()
        self._seq = 0
        self._closed = False
        self._warned = False
        self._threads: list[threading.Thread] = []
        # Counters (under _cv).
        self._pending_bytes = 0  # staged or queued, not yet written
        self._peak_pending = 0
        self._live_file_bytes = 0
        self._peak_file_bytes = 0
        self._files = 0
        self._received = 0  # bytes copied into the tier (what d2h_bytes reconciles with)
        self._count = 0
        self._written = 0
        self._write_s = 0.0
        self._read = 0
        self._read_s = 0.0
        self._wait_s = 0.0
        self._prefetched = 0  # bytes read ahead, not yet loaded
        self._refused = 0
        self._refused_bytes = 0
        self._write_failures = 0
        self._memory_bytes = 0
        self._cancelled = 0
        self._oversize = 0
        self._last_error = ""
        self._undeleted: list[str] = []
        for i in range(self.writers):
            self._start(self._writer_loop, f"offload-disk-writer-{i}")
        for i in range(self.readers):
            self._start(self._reader_loop, f"offload-disk-reader-{i}")

    def _start(self, fn: Callable[[weakref.ref], None], name: str) -> None:
        t = threading.Thread(target=fn, args=(weakref.ref(self),), name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # -- compute thread: reserve and submit -------------------------------------------

    def _free_bytes(self) -> int:
        """Bytes the tier may still add: the budget, or the free space less a margin."""
        if self.budget_bytes is not None:
            return self.budget_bytes - self._live_file_bytes
        try:
            du = shutil.disk_usage(self.run_dir)
        except OSError:
            return 0
        return du.free - min(_GiB, du.total // 20)

    def reserve(self, nbytes: int) -> DiskRecord | None:
        """A record with a file allocated for ``nbytes`` and a staging buffer, or None (falls through)."""
        if self._closed:
            return None
        need = HEADER_BYTES + nbytes
        if self._free_bytes() < need:
            with self._cv:
                self._refused += 1
                self._refused_bytes += nbytes
            if self.budget_bytes is None:
                self._warn_once(nbytes, "not enough free space (the tier keeps a margin of "
                                "min(1 GiB, 5% of the file system) free)")
            return None
        with self._cv:
            seq = self._seq
            self._seq += 1
        path = os.path.join(self.run_dir, f"{seq:012d}.bin")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                try:
                    os.posix_fallocate(fd, 0, need)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
            finally:
                os.close(fd)
        except OSError as e:
            try:
                os.unlink(path)
            except OSError:
                pass
            with self._cv:
                self._refused += 1
                self._refused_bytes += nbytes
            self._warn_once(nbytes, f"{os.strerror(e.errno) if e.errno else e}")
            return None
        rec = DiskRecord(seq, nbytes, path)
        t0 = time.perf_counter()
        with self._cv:
            self._live_file_bytes += need
            self._peak_file_bytes = max(self._peak_file_bytes, self._live_file_bytes)
            self._files += 1
            self._received += nbytes
            self._count += 1
            while True:
                if self._pending_bytes == 0 or self._pending_bytes + nbytes <= self.queue_bytes:
                    buf = self._staging.take(nbytes)
                    if buf is not None:
                        break
                    if self._pending_bytes == 0:
                        buf = None  # bigger than the bound (or fragmented): a one-off buffer
                        self._oversize += 1
                        break
                self._cv.wait()
            self._pending_bytes += nbytes
            self._peak_pending = max(self._peak_pending, self._pending_bytes)
        waited = time.perf_counter() - t0
        if buf is None:
            rec.tensor = torch.empty(nbytes, dtype=torch.uint8)
        else:
            rec.tensor = buf.tensor
            rec.pooled_staging = buf
        if waited > 1e-4:
            with self._cv:
                self._wait_s += waited
            self._time("wait", waited, 0)
        return rec

    def submit(self, rec: DiskRecord, copy: Any = None) -> None:
        """Queue ``rec`` for writing once ``copy`` (a streams.Copy into its staging buffer) is done."""
        rec.copy = copy
        with self._cv:
            if rec.state != "staged":
                return
            rec.state = "queued"
            self._queue.append(rec)
            self._cv.notify_all()

    def _warn_once(self, nbytes: int, cause: str) -> None:
        self._last_error = cause
        if self._warned:
            return
        self._warned = True
        warn_user(
            f"offload disk tier: cannot write {nbytes} bytes to {self.run_dir!r} ({cause}); this "
            "tensor and any later one that does not fit goes to the next tier (on_host_budget: keep "
            "it on the device, or raise). Free space there, point disk_dir at a larger or writable "
            "directory, or lower disk_budget_bytes. Counted in ctx.tiers.stats()['disk']['refused_bytes']."
        )

    def _time(self, kind: str, seconds: float, nbytes: int) -> None:
        if self._on_time is not None:
            try:
                self._on_time(kind, seconds, nbytes)
            except Exception:  # accounting must never break a write
                pass

    # -- writer threads ------------------------------------------------------------------

    @staticmethod
    def _writer_loop(ref: weakref.ref) -> None:
        while True:
            self = ref()
            if self is None:
                return
            cv = self._cv
            with cv:
                while not self._queue and not self._closed:
                    del self
                    cv.wait(0.5)
                    self = ref()
                    if self is None:
                        return
                if self._closed and not self._queue:
                    return
                rec = self._queue.popleft()
            self._write(rec)
            del self, rec

    def _write(self, rec: DiskRecord) -> None:
        copy = rec.copy
        rec.copy = None
        if copy is not None and getattr(copy, "done", None) is not None:
            copy.done.synchronize()
        with self._cv:
            if rec.state != "queued":  # released (or closed) before it was written
                self._unstage(rec)
                return
        t0 = time.perf_counter()
        data = memoryview(rec.tensor.numpy()).cast("B")
        crc = zlib.crc32(data)
        err: OSError | None = None
        try:
            fd = os.open(rec.path, os.O_WRONLY)
            try:
                _write_all(fd, memoryview(_HEADER.pack(_MAGIC, self.token, rec.seq, rec.nbytes, crc)), 0)
                _write_all(fd, data, HEADER_BYTES)
            finally:
                os.close(fd)
        except OSError as e:
            err = e
        secs = time.perf_counter() - t0
        del data
        with self._cv:
            if rec.state == "queued":
                if err is None:
                    rec.state = "on_disk"
                    rec.crc = crc
                    self._written += rec.nbytes
                    self._write_s += secs
                else:
                    rec.memory = rec.tensor.clone()  # the staging range goes back; the bytes stay
                    rec.state = "in_memory"
                    self._write_failures += 1
                    self._memory_bytes += rec.nbytes
            self._unstage(rec)
        if err is None:
            self._time("write", secs, rec.nbytes)
        elif rec.state == "in_memory":
            self._warn_once(rec.nbytes, f"{os.strerror(err.errno) if err.errno else err}; the bytes are "
                            "kept in host memory")

    def _unstage(self, rec: DiskRecord) -> None:
        """Give ``rec``'s staging buffer back and wake reserves waiting for room (``_cv`` held)."""
        if rec.tensor is None:
            return
        if rec.pooled_staging is not None:
            self._staging.give(rec.pooled_staging)
        rec.tensor = rec.pooled_staging = None
        self._pending_bytes -= rec.nbytes
        self._cv.notify_all()

    # -- reads -----------------------------------------------------------------------

    def prefetch(self, rec: DiskRecord) -> bool:
        """Start reading ``rec`` on a reader thread (if written and within ``readahead_bytes``)."""
        with self._cv:
            if rec.state != "on_disk" or rec.read is not None:
                return False
            if self._prefetched + rec.nbytes > self.readahead_bytes and self._prefetched:
                return False
            rec.read = [threading.Event(), None]
            rec.read_bytes = rec.nbytes
            self._prefetched += rec.nbytes
            self._reads.append((rec, rec.read))
            self._cv.notify_all()
            return True

    @staticmethod
    def _reader_loop(ref: weakref.ref) -> None:
        while True:
            self = ref()
            if self is None:
                return
            cv = self._cv
            with cv:
                while not self._reads and not self._closed:
                    del self
                    cv.wait(0.5)
                    self = ref()
                    if self is None:
                        return
                if self._closed:
                    return
                rec, slot = self._reads.popleft()
                wanted = rec.read is slot  # else released meanwhile (load already took it: still wanted)
                wanted = wanted or rec.state == "on_disk"
            if wanted:
                try:
                    slot[1] = self._read_file(rec)
                except BaseException as e:  # handed to load(), on the compute thread
                    slot[1] = e
            slot[0].set()
            del self, rec, slot

    def _read_file(self, rec: DiskRecord) -> torch.Tensor:
        t0 = time.perf_counter()
        out = torch.empty(rec.nbytes, dtype=torch.uint8)
        try:
            fd = os.open(rec.path, os.O_RDONLY)
        except OSError as e:
            raise self._corrupt(rec, f"it cannot be opened ({os.strerror(e.errno)})") from e
        try:
            size = os.fstat(fd).st_size
            if size != HEADER_BYTES + rec.nbytes:
                raise self._corrupt(rec, f"it holds {size} bytes, expected {HEADER_BYTES + rec.nbytes}")
            head = os.pread(fd, HEADER_BYTES, 0)
            magic, token, seq, nbytes, crc = _HEADER.unpack(head)
            if magic != _MAGIC or token != self.token:
                raise self._corrupt(rec, "its header is not this run's (a foreign or overwritten file)")
            if seq != rec.seq or nbytes != rec.nbytes:
                raise self._corrupt(rec, f"its header says record {seq} of {nbytes} bytes, expected "
                                    f"record {rec.seq} of {rec.nbytes}")
            data = memoryview(out.numpy()).cast("B")
            got = _read_all(fd, data, HEADER_BYTES)
            if got != rec.nbytes:
                raise self._corrupt(rec, f"only {got} of {rec.nbytes} bytes could be read")
            if crc != rec.crc or zlib.crc32(data) != crc:
                raise self._corrupt(rec, "its bytes do not match the checksum written with them")
        finally:
            os.close(fd)
        secs = time.perf_counter() - t0
        with self._cv:
            self._read += rec.nbytes
            self._read_s += secs
        self._time("read", secs, rec.nbytes)
        return out

    def _closed_error(self) -> DiskTierError:
        return DiskTierError(
            f"offload disk tier: {self.run_dir!r} was closed (ctx.close()) and its files deleted, so "
            "a backward through a graph built before close() cannot get its saved tensors back. "
            "Run every backward before ctx.close()."
        )

    def _corrupt(self, rec: DiskRecord, what: str) -> DiskTierError:
        return DiskTierError(
            f"offload disk tier: the file {rec.path!r} of a saved tensor ({rec.nbytes} bytes) does not "
            f"hold what was written: {what}. Something else changed the run directory (another "
            "process, a cleanup job, a disk error); the gradient cannot be computed from it. Give "
            "every job its own disk_dir on a local disk, then rerun the step."
        )

    def load(self, rec: DiskRecord) -> torch.Tensor:
        """The bytes of ``rec`` as a flat uint8 host tensor (checked; see NOTE [ Disk tier ])."""
        t0 = time.perf_counter()
        with self._cv:
            while rec.state in ("staged", "queued"):
                self._cv.wait()
            if rec.state == "in_memory":
                return rec.memory
            if self._closed:
                raise self._closed_error()
            if rec.state != "on_disk":
                raise DiskTierError(f"offload disk tier: record {rec.seq} was released ({rec.state}) "
                                    "while its handle lives; this is a bug in offload, please report it.")
            slot = rec.read
            rec.read = None
            if slot is not None:
                self._prefetched -= rec.read_bytes
        if slot is not None:
            slot[0].wait()
            out = slot[1]
            if isinstance(out, BaseException):
                raise out
        else:
            out = self._read_file(rec)
        waited = time.perf_counter() - t0
        with self._cv:
            self._wait_s += waited
        self._time("wait", waited, 0)
        return out

    # -- release ---------------------------------------------------------------------

    def give(self, rec: DiskRecord) -> None:
        """The handle holding ``rec`` died (Rule 1): cancel its write, delete its file."""
        with self._cv:
            state = rec.state
            if state == "released":
                return
            rec.state = "released"
            if rec.read is not None:
                self._prefetched -= rec.read_bytes
                rec.read = None
            if state in ("staged", "queued"):
                self._cancelled += 1
                if state == "staged":  # never submitted: no writer will give its staging back
                    self._unstage(rec)
            if state == "in_memory":
                self._memory_bytes -= rec.nbytes
                rec.memory = None
            self._live_file_bytes -= HEADER_BYTES + rec.nbytes
            self._files -= 1
        self._unlink(rec.path)

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:  # a read-only file system, say: retried at the end of every step
            with self._cv:
                self._undeleted.append(path)

    def end_step(self) -> None:
        """End of a training step: retry deleting files that could not be deleted; the staging
        pool may release what recent steps did not need."""
        if self._undeleted:
            with self._cv:
                paths, self._undeleted = self._undeleted, []
            for path in paths:
                self._unlink(path)
        self._staging.trim()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (tests, benchmarks). True if drained."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending_bytes and not self._closed:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        """Stop the threads, delete every file, the lock and the run directory (idempotent)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for rec in self._queue:
                rec.state = "released"
            self._queue.clear()
            for _rec, slot in self._reads:
                slot[1] = self._closed_error()
                slot[0].set()
            self._reads.clear()
            self._cv.notify_all()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(timeout=30)
        self._finalizer()
        if self._created_parent:
            try:
                os.rmdir(self.parent)
            except OSError:
                pass

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, Any]:
        """Counters: ``received_bytes`` (copied into the tier; reconciles with the ledger's
        ``d2h_bytes``), ``file_bytes`` now / peak, files, written / read bytes and seconds,
        exposed ``wait_seconds``, pending bytes (bound ``queue_bytes``), refusals, failures."""
        with self._cv:
            return {
                "dir": self.run_dir,
                "received_bytes": self._received,
                "count": self._count,
                "file_bytes": self._live_file_bytes,
                "peak_file_bytes": self._peak_file_bytes,
                "files": self._files,
                "budget_bytes": self.budget_bytes,
                "written_bytes": self._written,
                "write_seconds": self._write_s,
                "read_bytes": self._read,
                "read_seconds": self._read_s,
                "wait_seconds": self._wait_s,
                "pending_bytes": self._pending_bytes,
                "peak_pending_bytes": self._peak_pending,
                "queue_bytes": self.queue_bytes,
                "staging_reserved_bytes": self._staging.reserved_bytes,
                "refused": self._refused,
                "refused_bytes": self._refused_bytes,
                "write_failures": self._write_failures,
                "memory_bytes": self._memory_bytes,
                "cancelled": self._cancelled,
                "undeleted": len(self._undeleted),
                "oversize": self._oversize,
            }
