"""The disk tier's store on its own (NOTE [ Disk tier ]): files, lock, checks, cleanup, bounds;
the ledger's per-tier figures."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap
import shutil
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from offload.disk import HEADER_BYTES, LOCK_NAME, RUN_PREFIX, DiskStore, DiskTierError


def _put(store: DiskStore, t: torch.Tensor):
    rec = store.reserve(t.numel())
    assert rec is not None
    rec.tensor.copy_(t)
    store.submit(rec)
    return rec


def _bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _files(store: DiskStore) -> list[str]:
    return sorted(n for n in os.listdir(store.run_dir) if n != LOCK_NAME)


def test_round_trip_in_any_order_and_prefetched(tmp_path):
    """Bytes come back exactly, read ahead or not, in any order; the run dir holds only LOCK and records."""
    store = DiskStore(tmp_path / "d", queue_bytes=1 << 20)
    data = [_bytes(1000 + 37 * i, i) for i in range(30)]
    recs = [_put(store, t) for t in data]
    for rec in recs[::3]:
        store.prefetch(rec)
    for i in [5, 0, 29, 3, 17, 3]:  # repeated reads (retain_graph, double backward) read again
        assert torch.equal(store.load(recs[i]), data[i])
    assert len(_files(store)) == 30 and set(os.listdir(store.run_dir)) - set(_files(store)) == {LOCK_NAME}
    assert store.drain(timeout=60)  # records not read back may still be in the writer's queue
    st = store.stats()
    assert st["received_bytes"] == st["written_bytes"] == sum(t.numel() for t in data)
    assert st["file_bytes"] == st["received_bytes"] + 30 * HEADER_BYTES
    for rec in recs:
        store.give(rec)
    assert _files(store) == [] and store.stats()["file_bytes"] == 0
    store.close()
    assert not (tmp_path / "d").exists(), "close() removes the run dir and the dir it created"


def test_pending_bytes_stay_within_the_queue_bound(tmp_path):
    """Host bytes staged for writing never exceed queue_bytes (a reserve waits), except one
    request bigger than the bound, which waits for an empty queue and is counted."""
    bound = 256 << 10
    store = DiskStore(tmp_path, queue_bytes=bound)
    recs = [_put(store, _bytes(60_000, i)) for i in range(40)]
    big = _put(store, _bytes(bound + 1, 99))
    store.drain()
    st = store.stats()
    assert st["peak_pending_bytes"] <= bound + 1, st
    assert st["oversize"] == 1 and st["pending_bytes"] == 0, st
    assert torch.equal(store.load(big), _bytes(bound + 1, 99))
    assert torch.equal(store.load(recs[7]), _bytes(60_000, 7))
    store.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "swap", "missing"])
def test_damaged_file_is_a_named_error(tmp_path, damage):
    """A changed, truncated, foreign, swapped or missing file raises DiskTierError, never wrong bytes."""
    store = DiskStore(tmp_path, queue_bytes=1 << 20)
    a, b = _put(store, _bytes(5000, 1)), _put(store, _bytes(5000, 2))
    store.drain()
    if damage == "flip":
        with open(a.path, "r+b") as f:
            f.seek(HEADER_BYTES + 4321)
            old = f.read(1)
            f.seek(HEADER_BYTES + 4321)
            f.write(bytes([old[0] ^ 1]))
    elif damage == "truncate":
        os.truncate(a.path, HEADER_BYTES + 4000)
    elif damage == "foreign":
        other = DiskStore(tmp_path / "other")
        c = _put(other, _bytes(5000, 1))
        other.drain()
        with open(c.path, "rb") as src, open(a.path, "wb") as dst:
            dst.write(src.read())
        other.close()
    elif damage == "swap":
        os.replace(b.path, a.path)
    else:
        os.unlink(a.path)
    with pytest.raises(DiskTierError, match="is gone: it was deleted" if damage == "missing"
                       else "does not hold what was written"):
        store.load(a)
    store.prefetch(a) if damage != "missing" and damage != "swap" else None
    store.close()


def test_release_before_write_cancels_it(tmp_path):
    """A record given back before its write ran is never written and leaves no file."""
    store = DiskStore(tmp_path, queue_bytes=1 << 20)
    rec = store.reserve(10_000)  # staged, not submitted: no writer touches it
    store.give(rec)
    assert _files(store) == [] and store.stats()["pending_bytes"] == 0
    recs = [_put(store, _bytes(100_000, i)) for i in range(20)]
    for r in recs:
        store.give(r)
    store.drain()
    assert _files(store) == [] and store.stats()["files"] == 0
    store.close()


def test_disk_dir_that_is_a_file_is_refused(tmp_path):
    """disk_dir naming a file: a ValueError that names it."""
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        DiskStore(f)


def test_budget_refuses_then_falls_through_with_one_warning(tmp_path):
    """Over disk_budget_bytes a reserve returns None (counted) and nothing is written."""
    store = DiskStore(tmp_path, budget_bytes=3 * (HEADER_BYTES + 1000))
    recs = [store.reserve(1000) for _ in range(5)]
    assert [r is not None for r in recs] == [True, True, True, False, False]
    assert store.stats()["refused"] == 2
    for r in recs[:3]:
        store.give(r)
    assert store.reserve(1000) is not None, "room comes back with released records"
    store.close()


def test_unwritable_dir_falls_through_with_one_warning(tmp_path, monkeypatch):
    """A file system error at reserve (ENOSPC, EROFS) returns None with one warning naming the
    directory and the bytes."""
    store = DiskStore(tmp_path)

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.warns(UserWarning, match=r"cannot write 4096 bytes to .*offload-.*No space left") as w:
        assert store.reserve(4096) is None
        assert store.reserve(8192) is None
    assert len(w) == 1
    assert _files(store) == [] and store.stats()["refused_bytes"] == 4096 + 8192
    store.close()


def test_failed_write_keeps_the_bytes(tmp_path, monkeypatch):
    """A write that fails after reserve keeps the bytes in host memory: load still returns them."""
    store = DiskStore(tmp_path)
    real = os.pwrite

    def failing(fd, data, off):
        raise OSError(errno.EIO, "simulated I/O error")

    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.warns(UserWarning, match="kept in host memory"):
        rec = _put(store, _bytes(3000, 5))
        store.drain()
    monkeypatch.setattr(os, "pwrite", real)
    assert torch.equal(store.load(rec), _bytes(3000, 5))
    assert store.stats()["write_failures"] == 1 and store.stats()["memory_bytes"] == 3000
    store.give(rec)
    assert store.stats()["memory_bytes"] == 0
    store.close()


def test_collected_store_deletes_its_run_dir(tmp_path):
    """A store dropped without close() (its engine freed) still deletes its run directory."""
    store = DiskStore(tmp_path)
    _put(store, _bytes(1000, 0))
    store.drain()  # (a writer thread holds the store while it writes)
    run_dir = store.run_dir
    del store
    gc.collect()
    assert not os.path.exists(run_dir)


def test_other_live_runs_are_left_alone(tmp_path):
    """A second store in the same disk_dir (another engine or rank) does not touch a live run."""
    a = DiskStore(tmp_path)
    ra = _put(a, _bytes(2000, 0))
    b = DiskStore(tmp_path)
    assert b.stale_cleaned == [] and os.path.exists(ra.path)
    assert torch.equal(a.load(ra), _bytes(2000, 0))
    b.close()
    a.close()


_KILLED = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {root!r})
    from offload.disk import DiskStore
    s = DiskStore({dir!r})
    for i in range(5):
        r = s.reserve(10000); r.tensor.fill_(i); s.submit(r)
    s.drain()
    print(s.run_dir, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_dir_of_a_killed_process_is_cleaned_at_next_start(tmp_path):
    """SIGKILL leaves the run dir behind; the next store in disk_dir deletes it (its lock was
    released by the kernel) and logs whose it was."""
    code = _KILLED.format(root=os.getcwd(), dir=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    left = p.stdout.strip()
    assert os.path.isdir(left) and len(os.listdir(left)) == 6
    with open(os.path.join(left, LOCK_NAME)) as f:
        assert "pid=" in f.read()
    store = DiskStore(tmp_path)
    assert store.stale_cleaned == [os.path.basename(left)] and not os.path.exists(left)
    assert [n for n in os.listdir(tmp_path) if n.startswith(RUN_PREFIX)] == [os.path.basename(store.run_dir)]
    store.close()


def test_concurrent_puts_and_loads(tmp_path):
    """Two threads writing and reading their own records concurrently get their own bytes back."""
    store = DiskStore(tmp_path, queue_bytes=128 << 10)

    def work(k: int) -> None:
        recs = [(_put(store, _bytes(20_000 + i, 100 * k + i)), 100 * k + i) for i in range(25)]
        for rec, seed in reversed(recs):
            store.prefetch(rec)
            assert torch.equal(store.load(rec), _bytes(rec.nbytes, seed))
            store.give(rec)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(work, range(2)))  # both run at once; a failure in either is raised here
    assert _files(store) == []
    store.close()


def test_load_after_close_is_a_named_error(tmp_path):
    """A record loaded after close() (a graph kept past ctx.close()) raises DiskTierError, no hang."""
    store = DiskStore(tmp_path)
    rec = _put(store, _bytes(5000, 3))
    store.drain()
    store.prefetch(rec)
    store.close()
    with pytest.raises(DiskTierError, match="was closed"):
        store.load(rec)
    store.give(rec)  # the handle dying later is harmless
    assert not os.path.exists(store.run_dir)


def test_ledger_counts_bytes_and_time_per_tier():
    """The ledger's per-tier figures: copies logged per tier sum to d2h_bytes; summary() always
    names the three tiers; tier time from any thread lands in the open step."""
    from offload.ledger import TIERS, Ledger, PackRecord

    led = Ledger()
    for i, tier in enumerate(["pool", "disk", "disk", "pageable"]):
        rec = PackRecord(i, 0, 100, (25,), "torch.float32", "cpu", "m", "offloaded", "",
                         copy_bytes=128 * (i + 1), tier=tier)
        led.add(rec)
    t = threading.Thread(target=led.add_tier_time, args=("disk", 0.5, 0.25))
    t.start()
    t.join()
    led.close_step()
    s = led.summary()
    assert set(s["tiers"]) == set(TIERS)
    assert s["tiers"]["disk"] == {"bytes": 128 * 5, "count": 2, "seconds": 0.5, "wait_seconds": 0.25}
    assert sum(v["bytes"] for v in s["tiers"].values()) == s["d2h_bytes"]
    assert led.step_totals[-1].tiers["pool"]["count"] == 1
    assert Ledger().summary()["tiers"]["pageable"]["bytes"] == 0


# -- the run directory's life: nested parents, read-only disk_dir, close then reuse (issue 35) --


def test_close_removes_only_the_parents_it_made(tmp_path):
    """A missing nested disk_dir (a/b/c) is made for the run and removed again by close(), every
    level it made; a directory something else put a file in stays, with the ones above it."""
    store = DiskStore(tmp_path / "a" / "b" / "c")
    _put(store, _bytes(1000, 0))
    store.close()
    assert os.listdir(tmp_path) == [], "close() left parents it made"
    store = DiskStore(tmp_path / "a" / "b" / "c")
    (tmp_path / "a" / "b" / "note").write_text("the user's")
    store.close()
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["note"], "a directory holding another file stays"


def _read_only_mkdir(monkeypatch, under):
    real = os.mkdir

    def mkdir(path, *a, **k):
        if str(path).startswith(str(under)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)


def test_read_only_disk_dir_falls_through_with_one_warning(tmp_path, monkeypatch):
    """A disk_dir that cannot be written is no constructor error: one warning names disk_dir,
    every reserve falls through (counted), and the directory is tried again once per step."""
    _read_only_mkdir(monkeypatch, tmp_path)
    with pytest.warns(UserWarning, match=r"disk_dir=.*Read-only file system") as w:
        store = DiskStore(tmp_path / "ro")
        assert store.reserve(4096) is None and store.reserve(100) is None
        store.end_step()
        assert store.reserve(100) is None
    assert len(w) == 1
    st = store.stats()
    assert st["refused_bytes"] == 4296 and not st["open"] and not os.listdir(tmp_path)
    monkeypatch.undo()
    assert store.reserve(100) is None, "retried once per step, not per copy"
    store.end_step()
    assert store.reserve(100) is not None, "writable again: the next step opens a run directory"
    store.close()


def test_write_failure_warning_says_the_bytes_stay_in_host_memory(tmp_path, monkeypatch):
    """A failed write keeps its bytes in host memory (counted under the disk tier), and its warning
    says so, not that they went to the next tier; a later refusal warns once with where it goes."""
    store = DiskStore(tmp_path)
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.warns(UserWarning) as w:
        rec = _put(store, _bytes(3000, 5))
        store.drain()
        monkeypatch.setattr(os, "posix_fallocate", lambda fd, o, n: (_ for _ in ()).throw(
            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
        assert store.reserve(4096) is None
    write, refuse = (str(x.message) for x in w)
    assert "kept in host memory" in write and "next tier" not in write and "on_host_budget" not in write
    assert "No space left" in refuse and "on_host_budget" in refuse
    assert store.stats()["memory_bytes"] == 3000 and torch.equal(store.load(rec), _bytes(3000, 5))
    store.close()


def test_reserve_after_close_opens_a_new_run(tmp_path, caplog):
    """close() then reserve (an engine used again): a new run directory, logged; the closed run's
    records raise a named error and give nothing back twice; records queued at close give their
    staging back, so the new run does not wait for them."""
    store = DiskStore(tmp_path, queue_bytes=64 << 10)
    old = [_put(store, _bytes(30_000, i)) for i in range(2)]  # maybe still queued at close
    store.drain()
    first = store.run_dir
    store.close()
    assert store.stats()["pending_bytes"] == 0 and store.stats()["file_bytes"] == 0
    with caplog.at_level("INFO", logger="offload.disk"):
        new = _put(store, _bytes(60_000, 9))  # waits forever if the closed run held the queue
    assert store.run_dir != first and os.path.isdir(store.run_dir) and not os.path.exists(first)
    assert any("opened" in r.getMessage() and "ctx.close()" in r.getMessage() for r in caplog.records)
    with pytest.raises(DiskTierError, match="was closed"):
        store.load(old[0])
    for rec in old:
        store.give(rec)
    assert store.stats()["file_bytes"] == HEADER_BYTES + 60_000 and store.stats()["opens"] == 2
    assert torch.equal(store.load(new), _bytes(60_000, 9))
    store.close()
    assert os.listdir(tmp_path) == []


def test_deleted_disk_dir_is_made_again(tmp_path, caplog):
    """disk_dir deleted between steps (a tmp cleaner): the next reserve makes the run directory again
    at the same path (counted, logged, one warning saying what happened, not blaming free space); the
    files that went with it raise a named error, new ones round-trip; close removes what it made."""
    parent = tmp_path / "disk"
    store = DiskStore(parent)
    old = _put(store, _bytes(5000, 1))
    store.drain()
    run_dir = store.run_dir
    shutil.rmtree(parent)
    with caplog.at_level("INFO", logger="offload.disk"), pytest.warns(UserWarning) as w:
        new = [_put(store, _bytes(3000, i)) for i in range(3)]
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and "was deleted" in msgs[0] and "free space" not in msgs[0], msgs
    assert store.run_dir == run_dir and os.path.isdir(run_dir)
    assert store.stats()["recreated"] == 1 and store.stats()["refused"] == 0
    assert any("made it again" in r.getMessage() for r in caplog.records)
    assert os.path.exists(os.path.join(run_dir, LOCK_NAME))
    with pytest.raises(DiskTierError, match="is gone: its run directory was deleted"):
        store.load(old)
    store.drain()
    for i, rec in enumerate(new):
        assert torch.equal(store.load(rec), _bytes(3000, i))
    shutil.rmtree(run_dir)  # once more: counted, no second warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _put(store, _bytes(100, 7))
    assert store.stats()["recreated"] == 2
    store.close()
    assert os.listdir(tmp_path) == [], "close removes the run directory and the disk_dir it made again"


def test_copies_not_yet_written_survive_a_deleted_run_dir(tmp_path):
    """A copy reserved before the run directory vanished and written after keeps its bytes in host
    memory: load returns them (nothing lost)."""
    store = DiskStore(tmp_path)
    rec = store.reserve(4000)
    rec.tensor.copy_(_bytes(4000, 3))
    shutil.rmtree(store.run_dir)
    with pytest.warns(UserWarning, match="was deleted"):
        store.submit(rec)
        store.drain()
    assert rec.state == "in_memory" and store.stats()["memory_bytes"] == 4000
    assert torch.equal(store.load(rec), _bytes(4000, 3))
    assert store.stats()["recreated"] == 1 and os.path.isdir(store.run_dir)
    store.close()
