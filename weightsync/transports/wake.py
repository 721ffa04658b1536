"""Internal. How parties wait on a shared segment's words (a bucket's ready word, a buffer's
release count): they sleep in the kernel on the word itself (a Linux futex on the shared mapping)
and the writer wakes them right after its store (:func:`wake`, :class:`Waiter`); where futexes
cannot work, short polling sleeps (:func:`poll_sleep`). The segments are memory.py's.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import sys
import time
from collections.abc import Callable

import numpy as np

# A receiver waiting for a bucket's ready word (and a sender waiting for receivers to release a
# buffer) used to sleep 10 .. 250 us between looks: up to 250 us late on every bucket, and
# ~4000 wake-ups a second per waiting process on a 2-core node. Here the waiter sleeps in the
# kernel on the word itself (a Linux futex on the segment's shared mapping: the futex key is the
# page and offset, so every process mapping the segment meets on it) and the writer wakes every
# sleeper right after it stores the word.
#
# - no lost wake-up: the waiter reads the word, checks its condition, then sleeps only while
#   the word still holds what it read (the kernel compares under its own lock); a store made
#   in between makes the sleep return at once;
# - futexes are 32-bit: we sleep on the low half of a uint64 word (little-endian only). A
#   store that leaves the low half equal (it never does for ready tags and versions, which
#   change their low bits every time) would only cost one sleep of at most ``max_s``;
# - every sleep is bounded by the caller (the next abort check, the deadline), so a writer
#   that dies before its wake-up costs no more than the polling did: failures still surface
#   on time as errors that name who failed;
# - where futexes are unavailable (not Linux, an unknown architecture, a big-endian machine,
#   a syscall that fails, WEIGHTSYNC_NOTIFY=poll) ``Waiter`` falls back to the short sleeps of
#   :func:`poll_sleep`.

# polling, the fallback: the first waits are short (a device bucket lands in tens of
# microseconds), later ones stay short too, since a pause overshoots the event by up to its
# own length on every bucket
POLL_FIRST_S, POLL_GROWTH, POLL_MAX_S = 10e-6, 1.5, 250e-6

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the sleepers are other processes
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _futex() -> Callable[..., int] | None:
    """libc's syscall() bound to SYS_futex, or None where futexes cannot be used (see above).
    ctypes releases the GIL for the call: a sleeping waiter holds up no other thread."""
    if os.environ.get("WEIGHTSYNC_NOTIFY", "futex") == "poll":
        return None  # forced polling: the fallback, measurable and testable on Linux
    number = _SYS_FUTEX.get(platform.machine().lower())
    if sys.platform != "linux" or number is None or sys.byteorder != "little":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32]
    return functools.partial(call, number)


def futex_available() -> bool:
    """True if waits here sleep on futexes, False if they poll."""
    return _futex() is not None


def _address(words: np.ndarray, index: int) -> int:
    return words.ctypes.data + index * words.itemsize


def wake(words: np.ndarray, index: int) -> None:
    """Wake every process sleeping on ``words[index]``; call right after storing it. Costs one
    syscall (about a microsecond) whether or not anyone sleeps."""
    futex = _futex()
    if futex is not None:
        futex(_address(words, index), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)


def poll_sleep(pause: float) -> float:
    """One polling pause; returns the next one."""
    time.sleep(pause)
    return min(pause * POLL_GROWTH, POLL_MAX_S)


class Waiter:
    """Sleeps until ``words[index]`` changes from what :meth:`look` saw, or ``max_s`` passed.
    Use: ``seen = w.look()``, check the condition, then ``w.sleep(seen, max_s)``."""

    def __init__(self, words: np.ndarray, index: int):
        if words.dtype.itemsize != 8:
            raise TypeError(f"Waiter needs uint64 words, got {words.dtype}")
        self.words, self.index = words, index
        self.futex = _futex()
        self.pause = POLL_FIRST_S

    def look(self) -> int:
        return int(self.words[self.index]) & 0xFFFFFFFF

    def sleep(self, seen: int, max_s: float) -> None:
        if max_s <= 0:
            return
        if self.futex is None:
            self.pause = poll_sleep(min(self.pause, max_s))
            return
        sec = int(max_s)
        ts = _Timespec(sec, int((max_s - sec) * 1e9))
        rc = self.futex(_address(self.words, self.index), _FUTEX_WAIT, seen, ctypes.byref(ts), None, 0)
        if rc != 0:
            err = ctypes.get_errno()
            # EAGAIN: the word changed before we slept; ETIMEDOUT, EINTR: look again
            if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
                self.futex = None  # e.g. ENOSYS under a sandbox: poll from now on
