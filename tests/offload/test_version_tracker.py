"""The engine's version trackers (Rule 6) follow a tensor's version counter without ever changing it."""

from __future__ import annotations

import sys
import threading

import torch

from offload import _torch_private


def test_tracker_follows_the_counter_and_drops_the_storage():
    """A tracker sees later in-place writes, holds no bytes, and leaves the version as it was."""
    a = torch.randn(64, requires_grad=True)
    t = a.exp()  # a saved output: the case a tracker exists for
    v = t._version
    tracker = _torch_private.version_tracker(t)
    assert tracker is not None
    assert t._version == tracker._version == v
    assert tracker.untyped_storage().nbytes() == 0
    with torch.no_grad():
        t.mul_(2)
    assert tracker._version == v + 1
    view = torch.arange(8)[2:6]  # a view: shares its base's counter
    tracker = _torch_private.version_tracker(view)
    view._base.add_(1)
    assert tracker._version == view._version == 1


def test_making_a_tracker_never_shows_another_thread_a_changed_version():
    """Another thread reading the version while trackers are made never sees it move.

    A tracker made by bumping the shared counter (``set_()``) and putting it
    back let a second thread sharing one engine read the bumped value and raise
    a false in-place error at unpack (one engine used from two threads, a batch
    tensor saved by both). Thread switches are forced every microsecond so the
    window is hit when it exists.
    """
    x = torch.ones(4)
    seen: set[int] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.add(x._version)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        th = threading.Thread(target=reader)
        th.start()
        try:
            for _ in range(20_000):
                _torch_private.version_tracker(x)
        finally:
            stop.set()
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert seen == {0}, seen
