"""One disk-tier record's file: a header (magic, the store's token, the record's sequence number,
its size, a CRC-32 of the bytes) then the bytes. Allocated before the copy, written whole, and
read back only after every check passes. See NOTE [ Disk tier ] in ``offload/disk.py``."""

from __future__ import annotations

import errno
import os
import struct
import zlib
from typing import Any

import torch

from .errors import OffloadError

__all__ = ["DiskRecord", "DiskTierError", "HEADER_BYTES", "RecordMismatch", "allocate", "write", "read_checked", "ready"]

_MAGIC = b"OFLDTNS1"
_HEADER = struct.Struct("<8s16sQQI4x")  # magic, store token, sequence, nbytes, crc32
HEADER_BYTES = _HEADER.size


class DiskRecord:
    """One tensor's bytes in the disk tier (quacks like a ``HostBuffer`` while staged)."""

    __slots__ = ("seq", "nbytes", "path", "tensor", "pooled_staging", "state", "crc", "copy", "read",
                 "read_bytes", "memory", "cache", "run", "owner", "__weakref__")
    pinned = False
    pooled = False

    def __init__(self, seq: int, nbytes: int, path: str, run: tuple[int, int] = (0, 0)) -> None:
        self.seq = seq
        self.run = run
        """(pid, n) of the run directory its file is in (DiskStore._run)."""
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
        self.owner: Any = None
        """What ``DiskStore(owner=)`` gave at reserve (the ledger step its move times belong to)."""


def ready(rec: DiskRecord) -> bool:
    """Whether ``DiskStore.load(rec)`` returns its bytes without waiting on a write or a read: the copy
    schedule asks before it reloads a record ahead of need (NOTE [ Copy schedule ]). Read without the
    store's lock: a stale "not ready" only defers the reload to the next unpack."""
    read = rec.read
    return rec.state == "in_memory" or (rec.state == "on_disk" and read is not None and read[0].is_set())


class DiskTierError(OffloadError):
    """A disk-tier file does not hold what was written (truncated, overwritten, foreign), or
    belongs to a run closed since (or to the process this one was forked from)."""


class RecordMismatch(Exception):
    """A record's file does not hold what was written; the text says how (the store words the error)."""


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


def allocate(path: str, nbytes: int) -> None:
    """Create the file of a record of ``nbytes`` and allocate its blocks, so a full disk or an
    unwritable directory shows now (OSError), before any byte is copied. Nothing is left on failure."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, HEADER_BYTES + nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        finally:
            os.close(fd)
    except OSError:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise


def write(path: str, token: bytes, seq: int, data: memoryview) -> int:
    """Write record ``seq``'s header and ``data`` into its allocated file; the CRC-32 written."""
    crc = zlib.crc32(data)
    fd = os.open(path, os.O_WRONLY)
    try:
        _write_all(fd, memoryview(_HEADER.pack(_MAGIC, token, seq, len(data), crc)), 0)
        _write_all(fd, data, HEADER_BYTES)
    finally:
        os.close(fd)
    return crc


def read_checked(path: str, into: memoryview, token: bytes, seq: int, crc: int) -> None:
    """Read record ``seq`` (``len(into)`` bytes, written with ``crc``) into ``into``; raises
    ``RecordMismatch`` unless the file's size, header and checksum are the ones written."""
    nbytes = len(into)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise RecordMismatch(f"it cannot be opened ({os.strerror(e.errno)})") from e
    try:
        size = os.fstat(fd).st_size
        if size != HEADER_BYTES + nbytes:
            raise RecordMismatch(f"it holds {size} bytes, expected {HEADER_BYTES + nbytes}")
        magic, f_token, f_seq, f_nbytes, f_crc = _HEADER.unpack(os.pread(fd, HEADER_BYTES, 0))
        if magic != _MAGIC or f_token != token:
            raise RecordMismatch("its header is not this run's (a foreign or overwritten file)")
        if f_seq != seq or f_nbytes != nbytes:
            raise RecordMismatch(f"its header says record {f_seq} of {f_nbytes} bytes, expected "
                                 f"record {seq} of {nbytes}")
        got = _read_all(fd, into, HEADER_BYTES)
        if got != nbytes:
            raise RecordMismatch(f"only {got} of {nbytes} bytes could be read")
        if f_crc != crc or zlib.crc32(into) != f_crc:
            raise RecordMismatch("its bytes do not match the checksum written with them")
    finally:
        os.close(fd)
