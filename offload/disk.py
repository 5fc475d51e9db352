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
  buffer of its own, after the queue has drained). Staging that needs new
  host memory asks ``grow_gate``, the RAM ceiling (NOTE [ Host tiers ]).
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
  deletes the file; ``close`` deletes every file, the lock, the run
  directory and the parents of ``disk_dir`` the store made (only those, and
  only while empty); a finalizer does the same at interpreter exit or when
  the store is collected.
- Life after ``close``, a ``disk_dir`` that cannot be written, and ``fork()``:
  NOTE [ Disk run life ] in ``offload/_disk_run.py``.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import weakref
import zlib
from collections import deque
from typing import Any, Callable

import torch

from . import _disk_record
from ._disk_messages import unreadable_error, warning_text
from ._disk_record import HEADER_BYTES, DiskRecord, DiskTierError, RecordMismatch
from ._disk_run import _STORES, LOCK_NAME, RUN_PREFIX, RunLife
from ._warn import warn_user
from .pool import HostPool
from .streams import _FAULTS

__all__ = ["DiskStore", "DiskRecord", "DiskTierError", "RUN_PREFIX", "LOCK_NAME"]

_REFUSED = object()
"""What ``_take_staging`` returns when the RAM ceiling refuses the new host memory staging needs."""

_GiB = 1 << 30


class DiskStore(RunLife):
    """Files for tensor bytes under ``parent`` (see NOTE [ Disk tier ]). Thread-safe."""

    writers = 2
    """Writer threads."""
    readers = 1
    """Reader threads."""

    def __init__(self, parent: str, *, budget_bytes: int | None = None, queue_bytes: int = 256 << 20,
                 readahead_bytes: int = 256 << 20, pin: bool = False,
                 on_time: Callable[[str, float, int, Any], None] | None = None,
                 owner: Callable[[], Any] | None = None) -> None:
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
        self._on_time = on_time  # (kind "write"/"read"/"wait", seconds, bytes, the record's owner or None)
        self._owner = owner  # at reserve: the record's owner (a ledger step), which its times may outlive
        self._pin = pin
        self._staging = HostPool(pin=pin, capacity_bytes=queue_bytes)
        self._cv = threading.Condition()
        self._open_lock = threading.Lock()
        self._queue: deque[DiskRecord] = deque()
        self._reads: deque[tuple[DiskRecord, list]] = deque()
        self._seq = 0
        self._run: tuple[int, int] = (os.getpid(), 0)
        """(pid, n) of the open run directory: a record belongs to the run it was reserved in."""
        self.run_dir: str | None = None
        """The run directory (the last one, once closed); None if none could be made."""
        self.token = b""
        self._lock_fd = [-1]
        self._finalizer: weakref.finalize | None = None
        self._closed = True
        self._retry = True  # reserve may open the run directory (again); once per step after a failure
        self._warned: set[str] = set()
        self._threads: list[threading.Thread] = []
        self.stale_cleaned: list[str] = []
        """Run directories of dead processes deleted when this store opened."""
        self.opens = 0
        """How many times a run directory was made (more than 1: reopened after close() or a fork)."""
        self.recreated = 0
        """How many times the open run directory was made again after something deleted it."""
        self._zero_counters()
        self._open()
        _STORES.add(self)

    def _zero_counters(self) -> None:
        """The counters behind :meth:`stats` (changed under ``_cv``)."""
        # Bytes: staged or queued and not yet written (and its peak); in files (and peak); copied
        # into the tier (what d2h_bytes reconciles with); written; read; read ahead and not yet
        # loaded; kept in host memory after a failed write; refused.
        self._pending_bytes = self._peak_pending = self._live_file_bytes = self._peak_file_bytes = 0
        self._received = self._written = self._read = self._prefetched = self._memory_bytes = 0
        self._refused_bytes = 0
        # Counts, and seconds spent writing, reading and waiting.
        self._files = self._count = self._refused = self._write_failures = self._cancelled = 0
        self._oversize = self._ram_refused = 0
        self._write_s = self._read_s = self._wait_s = 0.0
        self._last_error = ""
        self._undeleted: list[str] = []

    def _start_threads(self) -> None:
        """The writer and reader threads of a newly opened run directory."""
        self._threads = []
        for i in range(self.writers):
            self._start(f"offload-disk-writer-{i}", DiskStore._take_write, DiskStore._write, drain=True)
        for i in range(self.readers):
            self._start(f"offload-disk-reader-{i}", DiskStore._take_read, DiskStore._serve_read, drain=False)

    def _start(self, name: str, take: Callable[[DiskStore], Any], handle: Callable[[DiskStore, Any], None],
               drain: bool) -> None:
        t = threading.Thread(target=DiskStore._serve, args=(weakref.ref(self), take, handle, drain), name=name,
                             daemon=True)
        t.start()
        self._threads.append(t)

    @staticmethod
    def _serve(ref: weakref.ref, take: Callable[[DiskStore], Any], handle: Callable[[DiskStore, Any], None],
               drain: bool) -> None:
        """Body of a writer or reader thread: wait for work, ``take`` it (``_cv`` held; None when
        there is none) and ``handle`` it, until the store is closed (with ``drain``: and nothing is
        left to take) or collected. The thread holds the store only while it works, so a store
        nobody closed is still collected (its finalizer deletes the run directory)."""
        while True:
            self = ref()
            if self is None:
                return
            cv = self._cv
            with cv:
                while True:
                    closed = self._closed
                    if closed and not drain:
                        return
                    item = take(self)
                    if item is not None:
                        break
                    if closed:
                        return
                    del self
                    cv.wait(0.5)
                    self = ref()
                    if self is None:
                        return
            handle(self, item)
            del self, item

    # -- compute thread: reserve and submit -------------------------------------------

    def _free_bytes(self) -> int:
        """Bytes the tier may still add: the budget, or the free space less a margin."""
        if self.budget_bytes is not None:
            return self.budget_bytes - self._live_file_bytes
        try:
            du = shutil.disk_usage(self.run_dir)
        except OSError:
            if not self._renew_if_gone():
                return 0
            try:
                du = shutil.disk_usage(self.run_dir)
            except OSError:
                return 0
        return du.free - min(_GiB, du.total // 20)

    def reserve(self, nbytes: int) -> DiskRecord | None:
        """A record with a file allocated for ``nbytes`` and a staging buffer, or None (falls through)."""
        if self._closed and not self._reopen():
            self._refuse(nbytes, None)  # disk_dir cannot be written: warned once when it failed
            return None
        need = HEADER_BYTES + nbytes
        if self._free_bytes() < need:
            self._refuse(nbytes, "not enough free space (the tier keeps a margin of min(1 GiB, 5% of the "
                         "file system) free)" if self.budget_bytes is None else None)
            return None
        t0 = time.perf_counter()
        with self._cv:
            buf = self._take_staging(nbytes)  # first: staging the RAM ceiling refuses makes no file
            seq = self._seq
            self._seq += 1
            run, run_dir = self._run, self.run_dir
        waited = time.perf_counter() - t0
        if buf is _REFUSED:
            self._refuse(nbytes, None)  # counted in ram_ceiling_refused, as the pool counts its own
            return None
        rec = DiskRecord(seq, nbytes, path=os.path.join(run_dir, f"{seq:012d}.bin"), run=run)
        rec.owner = self._owner() if self._owner is not None else None
        rec.tensor = torch.empty(nbytes, dtype=torch.uint8) if buf is None else buf.tensor
        rec.pooled_staging = buf
        try:
            try:
                _disk_record.allocate(rec.path, nbytes)
            except FileNotFoundError:
                if not self._renew_if_gone():
                    raise
                _disk_record.allocate(rec.path, nbytes)  # in the run directory made again
        except OSError as e:
            with self._cv:
                self._unstage(rec)
            self._refuse(nbytes, f"{os.strerror(e.errno) if e.errno else e}")
            return None
        with self._cv:
            self._live_file_bytes += need
            self._peak_file_bytes = max(self._peak_file_bytes, self._live_file_bytes)
            self._files += 1
            self._received += nbytes
            self._count += 1
        if waited > 1e-4:
            with self._cv:
                self._wait_s += waited
            self._time("wait", waited, 0)
        return rec

    def _refuse(self, nbytes: int, cause: str | None) -> None:
        """Count a reserve that falls through to the next tier; warn (once) when ``cause`` is given."""
        with self._cv:
            self._refused += 1
            self._refused_bytes += nbytes
        if cause is not None:
            self._warn_once("refuse", nbytes, cause)

    def _take_staging(self, nbytes: int) -> Any:
        """A staging buffer of ``nbytes`` from the private pool, once the bytes not yet written
        leave room under ``queue_bytes``; None for a one-off buffer (a request bigger than the
        bound, taken once the queue drained); ``_REFUSED`` when that needs new host memory and
        ``grow_gate`` (the RAM ceiling) refuses it. ``_cv`` held."""
        while True:
            if self._pending_bytes == 0 or self._pending_bytes + nbytes <= self.queue_bytes:
                buf = self._staging.take(nbytes)
                if buf is not None:
                    break
                if self._pending_bytes == 0:
                    gate = self._staging.grow_gate  # a one-off buffer is new host memory: asks
                    if gate is not None and not gate(nbytes):
                        self._ram_refused += 1
                        return _REFUSED
                    buf = None  # bigger than the bound (or fragmented): a one-off buffer
                    self._oversize += 1
                    break
            self._cv.wait()
        self._pending_bytes += nbytes
        self._peak_pending = max(self._peak_pending, self._pending_bytes)
        return buf

    def submit(self, rec: DiskRecord, copy: Any = None) -> None:
        """Queue ``rec`` for writing once ``copy`` (a streams.Copy into its staging buffer) is done."""
        rec.copy = copy
        with self._cv:
            if rec.state != "staged":
                return
            if self._closed or rec.run != self._run:  # closed since reserve: no writer will come
                if copy is not None and getattr(copy, "done", None) is not None:
                    copy.done.synchronize()
                rec.memory, rec.state = rec.tensor.clone(), "in_memory"
                self._unstage(rec)
                return
            rec.state = "queued"
            self._queue.append(rec)
            self._cv.notify_all()

    def _warn_once(self, kind: str, nbytes: int, cause: str) -> None:
        """One warning per ``kind`` per store (the kinds and what each says: ``warning_text``)."""
        self._last_error = cause
        if kind in self._warned:
            return
        self._warned.add(kind)
        warn_user(warning_text(kind, run_dir=self.run_dir, parent=self.parent, nbytes=nbytes, cause=cause))

    def _time(self, kind: str, seconds: float, nbytes: int, rec: DiskRecord | None = None) -> None:
        if self._on_time is not None:
            try:
                self._on_time(kind, seconds, nbytes, rec.owner if rec is not None else None)
            except Exception:  # accounting must never break a write
                pass

    # -- writer threads ------------------------------------------------------------------

    def _take_write(self) -> DiskRecord | None:
        """The next record to write (``_cv`` held), None if none is queued."""
        return self._queue.popleft() if self._queue else None

    def _write(self, rec: DiskRecord) -> None:
        copy = rec.copy
        rec.copy = None
        if copy is not None and getattr(copy, "done", None) is not None and not (
                _FAULTS and "disk_write_waits_copy" in _FAULTS):  # NOTE [ Ordering faults ]
            copy.done.synchronize()  # the D2H into the staging buffer is done before the host reads it
        with self._cv:
            if rec.state != "queued":  # released (or closed) before it was written
                self._unstage(rec)
                return
        t0 = time.perf_counter()
        data = memoryview(rec.tensor.numpy()).cast("B")
        crc = 0
        err: OSError | None = None
        try:
            crc = _disk_record.write(rec.path, self.token, rec.seq, data)
        except OSError as e:
            err = e
        secs = time.perf_counter() - t0
        del data
        # Its file went with the run directory: make that again now (its own warning), before the
        # bytes are kept and the staging goes back (so whoever waits for the write sees it done).
        renewed = isinstance(err, FileNotFoundError) and self._renew_if_gone() and self.recreated > 0
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
            self._time("write", secs, rec.nbytes, rec)
        elif renewed:
            pass  # the bytes are kept; the run directory's warning said so
        elif rec.state == "in_memory":
            self._warn_once("write", rec.nbytes, f"{os.strerror(err.errno) if err.errno else err}")

    def _unstage(self, rec: DiskRecord) -> None:
        """Give ``rec``'s staging buffer back and wake reserves waiting for room (``_cv`` held)."""
        if rec.tensor is None:
            return
        if rec.pooled_staging is not None:
            self._staging.give(rec.pooled_staging)
        rec.tensor = rec.pooled_staging = None
        self._pending_bytes -= rec.nbytes
        self._cv.notify_all()

    def holds(self, rec: DiskRecord, now: torch.Tensor) -> bool:
        """Whether ``rec`` holds the bytes ``now`` (its storage's current bytes, flat uint8: Rule 7's
        check of a shared copy): compared with the staged bytes while not yet written, else with the
        CRC-32 written with them, so the file is not read back."""
        with self._cv:
            state = rec.state
            if state == "in_memory":
                return torch.equal(rec.memory, now)
            if rec.run != self._run or self._closed:
                return False
            if state in ("staged", "queued") and rec.tensor is not None:
                return torch.equal(rec.tensor, now)
            if state != "on_disk":
                return False
            crc = rec.crc
        return zlib.crc32(memoryview(now.numpy()).cast("B")) == crc

    # -- reads -----------------------------------------------------------------------

    def prefetch(self, rec: DiskRecord) -> bool:
        """Start reading ``rec`` on a reader thread (if written and within ``readahead_bytes``)."""
        with self._cv:
            if rec.state != "on_disk" or rec.read is not None or rec.run != self._run:
                return False
            if self._prefetched + rec.nbytes > self.readahead_bytes and self._prefetched:
                return False
            rec.read = [threading.Event(), None]
            rec.read_bytes = rec.nbytes
            self._prefetched += rec.nbytes
            self._reads.append((rec, rec.read))
            self._cv.notify_all()
            return True

    def _take_read(self) -> tuple[DiskRecord, list, bool] | None:
        """The next read ahead (``_cv`` held) as (record, its slot, still wanted), None if none."""
        if not self._reads:
            return None
        rec, slot = self._reads.popleft()
        wanted = rec.read is slot  # else released meanwhile (load already took it: still wanted)
        return rec, slot, wanted or rec.state == "on_disk"

    def _serve_read(self, item: tuple[DiskRecord, list, bool]) -> None:
        """Read a record ahead into its slot (the bytes, or the error for ``load`` to raise)."""
        rec, slot, wanted = item
        if wanted:
            try:
                slot[1] = self._read_file(rec)
            except BaseException as e:  # handed to load(), on the compute thread
                slot[1] = e
        slot[0].set()

    def _read_file(self, rec: DiskRecord) -> torch.Tensor:
        t0 = time.perf_counter()
        out = torch.empty(rec.nbytes, dtype=torch.uint8)
        try:
            _disk_record.read_checked(rec.path, memoryview(out.numpy()).cast("B"), self.token, rec.seq, rec.crc)
        except RecordMismatch as e:
            raise unreadable_error(rec, str(e), self.recreated) from e.__cause__
        secs = time.perf_counter() - t0
        with self._cv:
            self._read += rec.nbytes
            self._read_s += secs
        self._time("read", secs, rec.nbytes, rec)
        return out

    def load(self, rec: DiskRecord) -> torch.Tensor:
        """The bytes of ``rec`` as a flat uint8 host tensor (checked; see NOTE [ Disk tier ])."""
        t0 = time.perf_counter()
        with self._cv:
            if rec.run != self._run or self._closed:  # a run closed since (or a forked parent's)
                if rec.state == "in_memory":
                    return rec.memory
                raise self._closed_error(rec)
            while rec.state in ("staged", "queued"):
                self._cv.wait()
            if rec.state == "in_memory":
                return rec.memory
            if self._closed:
                raise self._closed_error(rec)
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
                # Raised without a reference to it left in this frame: the error's traceback holds
                # the frame, and a cycle would keep the failed graph (and its ledger step) alive
                # until a garbage collection, so a retried step would share its records.
                slot[1] = None
                try:
                    raise out
                finally:
                    del out, slot
        else:
            out = self._read_file(rec)
        waited = time.perf_counter() - t0
        with self._cv:
            self._wait_s += waited
        self._time("wait", waited, 0)
        return out

    # -- release ---------------------------------------------------------------------

    def give(self, rec: DiskRecord) -> None:
        """The handle holding ``rec`` died (Rule 1): cancel its write, delete its file. A record of a
        run closed since has no file left to count or delete; one of a forked parent's run is the
        parent's (nothing here touches it)."""
        with self._cv:
            state = rec.state
            if state == "released":
                return
            rec.state = "released"
            if state == "in_memory":
                self._memory_bytes -= rec.nbytes
                rec.memory = None
            if rec.run != self._run or self._closed:
                if state == "staged" and rec.run[0] == os.getpid():
                    self._unstage(rec)
                return
            if rec.read is not None:
                self._prefetched -= rec.read_bytes
                rec.read = None
            if state in ("staged", "queued"):
                self._cancelled += 1
                if state == "staged":  # never submitted: no writer will give its staging back
                    self._unstage(rec)
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
        """End of a training step: retry deleting files that could not be deleted, and (next step)
        making a run directory that could not be made; the staging pool may release what recent
        steps did not need."""
        self._retry = True
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
        """Stop the threads, delete every file, the lock and the run directory, and the parents of
        ``disk_dir`` it made (idempotent). A later reserve opens a new run directory (logged)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for rec in self._queue:  # never written: their staging goes back now
                rec.state = "released"
                self._cancelled += 1
                self._unstage(rec)
            self._queue.clear()
            self._live_file_bytes = self._files = self._prefetched = 0
            for _rec, slot in self._reads:
                slot[1] = self._closed_error()
                slot[0].set()
            self._reads.clear()
            self._cv.notify_all()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(timeout=30)
        if self._finalizer is not None:
            self._finalizer()

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
                "open": not self._closed,
                "opens": self.opens,
                "recreated": self.recreated,
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
                "ram_ceiling_refused": self._ram_refused,
                "write_failures": self._write_failures,
                "memory_bytes": self._memory_bytes,
                "cancelled": self._cancelled,
                "undeleted": len(self._undeleted),
                "oversize": self._oversize,
            }

