"""The sim device's streams and events (weightsync_sim): each stream a queue of device work run
in order by a thread of its own, each item no earlier than a seeded random lag after it was
queued, so completions come late and in stream order, as on CUDA and NPU."""

from __future__ import annotations

import collections
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

KIND = "sim"
LAG_ENV, SEED_ENV = "SIMDEV_LAG_MS", "SIMDEV_SEED"
DEFAULT_LAG_MS = 5.0
_lock = threading.Lock()

class Stream:
    """A queue of device work run in order by a thread of its own, each item no earlier than a
    random lag after it was queued: completions come late and in stream order, as on CUDA."""

    def __init__(self, device: Any = None, priority: int = 0, *, seed: Any = None, lag_ms: float | None = None):
        self.device = torch.device(KIND, 0)
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[int, float, Callable[[], None]]] = collections.deque()
        self._issued = self._completed = 0
        self._error: BaseException | None = None
        self._closed = False
        self._rng = _rng() if seed is None else random.Random(seed)
        self._lag_s = _lag_s() if lag_ms is None else lag_ms / 1000.0
        self._thread = threading.Thread(target=self._run, name="sim-stream", daemon=True)
        self._thread.start()
        _streams.add(self)

    def enqueue(self, fn: Callable[[], None]) -> int:
        with self._cv:
            self._issued += 1
            due = time.monotonic() + self._rng.uniform(0.0, self._lag_s)
            self._queue.append((self._issued, due, fn))
            self._cv.notify_all()
            return self._issued

    def mark(self) -> int:
        """The position of the work queued so far (what an event recorded now waits for)."""
        with self._cv:
            return self._issued

    def done_through(self, seq: int) -> bool:
        with self._cv:
            return self._completed >= seq

    def wait_through(self, seq: int) -> None:
        with self._cv:
            while self._completed < seq:
                self._cv.wait(0.05)
            if self._error is not None:
                err, self._error = self._error, None
                raise RuntimeError(f"sim: an asynchronous device operation failed: {err!r}") from err

    def close(self) -> None:
        """Run what is queued, then stop the stream's thread."""
        self.synchronize()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    if self._closed:
                        return
                    self._cv.wait()
                seq, due, fn = self._queue[0]
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            try:
                fn()
            except BaseException as exc:  # surfaces at the next synchronize, as a device's async error
                with self._cv:
                    self._error = self._error or exc
            with self._cv:
                self._queue.popleft()
                self._completed = seq
                self._cv.notify_all()

    # torch.cuda.Stream's surface
    def synchronize(self) -> None:
        self.wait_through(self.mark())

    def query(self) -> bool:
        return self.done_through(self.mark())

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def wait_stream(self, other: Stream) -> None:
        self.wait_event(Event().record(other))

    def record_event(self, event: Event | None = None) -> Event:
        return (event or Event()).record(self)


class Event:
    """``torch.cuda.Event`` on a sim stream."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.stream: Stream | None = None
        self.seq = 0

    def record(self, stream: Stream | None = None) -> Event:
        self.stream = stream or current_stream()
        self.seq = self.stream.mark()
        return self

    def query(self) -> bool:
        return self.stream is None or self.stream.done_through(self.seq)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.wait_through(self.seq)

    def wait(self, stream: Stream | None = None) -> None:
        """Work queued on ``stream`` from now on runs after this event's work."""
        src, seq = self.stream, self.seq
        if src is None:
            return
        (stream or current_stream()).enqueue(lambda: src.wait_through(seq))


_default: Stream | None = None
_local = threading.local()


def default_stream(device: Any = None) -> Stream:
    global _default
    with _lock:
        if _default is None:
            _default = Stream()
        return _default


def current_stream(device: Any = None) -> Stream:
    return getattr(_local, "stream", None) or default_stream()


def set_stream(stream: Stream) -> None:
    _local.stream = stream


@contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    prev = getattr(_local, "stream", None)
    _local.stream = s
    try:
        yield
    finally:
        _local.stream = prev


_streams: weakref.WeakSet[Stream] = weakref.WeakSet()


def synchronize(device: Any = None) -> None:
    """Wait for every stream of the device."""
    for s in [default_stream(), *list(_streams)]:
        s.synchronize()


def _rng() -> random.Random:
    seed = os.environ.get(SEED_ENV)
    return random.Random(f"{seed}:{os.getpid()}:{threading.get_ident()}" if seed is not None else None)


def _lag_s() -> float:
    return float(os.environ.get(LAG_ENV, DEFAULT_LAG_MS)) / 1000.0


def configure(lag_ms: float | None = None, seed: int | None = None) -> None:
    """Set this process's lag and seed (a test in one process); streams made from now on use them."""
    if lag_ms is not None:
        os.environ[LAG_ENV] = str(lag_ms)
    if seed is not None:
        os.environ[SEED_ENV] = str(seed)


def reset_streams() -> None:
    """New default stream with the current lag and seed (the old one finishes its queue first)."""
    global _default
    old = _default
    with _lock:
        _default = None
    _local.stream = None
    if old is not None:
        old.close()
