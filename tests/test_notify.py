"""Blocking wake-ups on segment words (weightsync/transports/shm/transport.py): a sleeper on one
mapping of a segment is woken by a store + wake through another mapping of it (the way a
receiver and the sender map it), a store made before the sleep is never lost, and the polling
fallback keeps the same contract. The bounds here are minutes: they only tell a wake-up from
a sleep that runs to its own end."""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np
import pytest

from weightsync.errors import DeadlineExceeded
from weightsync.transports import Deadline
from weightsync.transports.shm import transport as wake
from weightsync.transports.shm.transport import poll_until

LONG_S = 300.0  # a sleep that is not woken lasts this long; the tests wait at most half of it


@pytest.fixture
def mappings():
    """Two mappings of one memfd, as two parties have them: the writer's read-write, the
    reader's read-only (receivers map segments read-only)."""
    fd = os.memfd_create("wsync-notify-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    rw = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)
    ro = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    writer, reader = np.frombuffer(rw, dtype=np.uint64), np.frombuffer(ro, dtype=np.uint64)
    yield writer, reader
    os.close(fd)  # the mappings go with the last array on them (pytest holds this fixture's value)


@pytest.fixture(params=["futex", "poll"])
def mode(request, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_NOTIFY", request.param)
    wake._futex.cache_clear()
    yield request.param
    wake._futex.cache_clear()


def _sleep_in_thread(waiter: wake.Waiter, seen: int) -> threading.Thread:
    t = threading.Thread(target=waiter.sleep, args=(seen, LONG_S), daemon=True)
    t.start()
    return t


def test_futex_is_used_on_this_linux_node(mode):
    assert wake.futex_available() == (mode == "futex")


def test_a_store_and_wake_through_another_mapping_ends_the_sleep(mappings, mode):
    writer, reader = mappings
    writer[5] = (7 << 24) | 3
    waiter = wake.Waiter(reader, 5)
    seen = waiter.look()
    t = _sleep_in_thread(waiter, seen)
    time.sleep(0.05)  # let it fall asleep (if it did not yet, the store below is seen at once)
    writer[5] = (7 << 24) | 4
    wake.wake(writer, 5)
    t.join(LONG_S / 2)
    assert not t.is_alive()


def test_a_store_before_the_sleep_is_not_lost(mappings, mode):
    writer, reader = mappings
    waiter = wake.Waiter(reader, 9)
    seen = waiter.look()
    writer[9] = 1  # no wake at all: the sleep must see that the word moved
    t = _sleep_in_thread(waiter, seen)
    t.join(LONG_S / 2)
    assert not t.is_alive()


def test_poll_until_with_a_waiter_returns_on_the_store(mappings, mode):
    writer, reader = mappings
    ticks = []

    def publish():
        time.sleep(0.3)
        writer[2] = 42
        wake.wake(writer, 2)

    threading.Thread(target=publish, daemon=True).start()
    poll_until(lambda: int(reader[2]) == 42, Deadline(1, time.monotonic() + LONG_S), "word 2",
               wake.Waiter(reader, 2), tick=lambda: ticks.append(1), tick_s=LONG_S)
    assert int(reader[2]) == 42


def test_poll_until_with_a_waiter_still_ticks_and_meets_its_deadline(mappings, mode):
    _, reader = mappings
    ticks = []
    with pytest.raises(DeadlineExceeded, match="word 3 was never written before the deadline"):
        poll_until(lambda: False, Deadline(1, time.monotonic() + 0.5), "word 3 was never written",
                   wake.Waiter(reader, 3), tick=lambda: ticks.append(1), tick_s=0.05)
    assert len(ticks) >= 2  # the abort checks ran while it slept
