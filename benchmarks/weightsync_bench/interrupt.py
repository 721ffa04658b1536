"""Internal. Stopping the benchmark when asked (Ctrl-C), and the progress bars it draws meanwhile.

Ctrl-C raised KeyboardInterrupt in the driver's ``ray.get``, and the rows' ``finally`` blocks
then asked every actor to close its session: calls queued behind the version the actor was
still in (one call at a time per actor), each waited up to ROW_TIMEOUT_S (600 s). So the
benchmark sat for minutes after Ctrl-C, while SIGTERM (no handler: the process just dies, Ray
reaps its workers) stopped it at once. Now an interrupted run kills its actors without asking
them anything, waits for their processes, and unlinks the segment files they left.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import ray

from weightsync.config import SyncConfig
from weightsync.transports.shm.transport import reap_stale

# the exit status of a process stopped by SIGINT, as a shell reports it
INTERRUPTED = 130


_asked = threading.Event()


@contextlib.contextmanager
def remember_ctrl_c() -> Iterator[None]:
    """While the bench runs, Ctrl-C is remembered as well as raised. The same Ctrl-C reaches the
    actors, whose calls then fail in the driver's ``ray.get`` as task errors, and a row records
    those as its error and goes on: the KeyboardInterrupt can be lost there (two full test runs
    saw the bench outlive Ctrl-C by 240 s; this is the likeliest way, not a captured one).
    ``check()`` at each row and version stops it all the same."""
    _asked.clear()
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        _asked.set()
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def asked() -> bool:
    """Whether Ctrl-C came (since ``remember_ctrl_c``)."""
    return _asked.is_set()


def check() -> None:
    """Raise KeyboardInterrupt if Ctrl-C came, even if the first one was swallowed."""
    if _asked.is_set():
        raise KeyboardInterrupt


def interrupt_close(actors: list[Any], pids: list[int]) -> None:
    """After Ctrl-C: kill every actor's process without asking anyone anything, wait (briefly)
    for them to exit and unlink the segment files they left (their creator is gone).

    The actors' processes are killed by pid first, which needs nothing from Ray: Ctrl-C reaches
    the whole process group, Ray's own daemons included, and ``ray.kill`` goes through the GCS.
    ``ray.kill`` still follows, in a daemon thread given a few seconds, so Ray forgets the actors
    when it can. (A main-suite run once saw the interrupted bench outlive the test's 240 s; it
    did not recur in six runs, so where it waited is not known.)"""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            proc.kill()
            procs.append(proc)
    forget = threading.Thread(target=_forget, args=(actors,), daemon=True, name="weightsync-bench-forget")
    forget.start()
    psutil.wait_procs(procs, timeout=30)
    forget.join(timeout=5)
    reap_stale(SyncConfig.from_env().shm_dir)


def _forget(actors: list[Any]) -> None:
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)


class Progress:
    """A tqdm bar on stderr when asked for and available; a no-op otherwise."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()

    @contextlib.contextmanager
    def bar(self, total: int, desc: str) -> Iterator[Any]:
        if not self.enabled:
            yield None
            return
        try:
            from tqdm import tqdm
        except ImportError:
            yield None
            return
        # position 1: below the run's overall bar (weightsync_bench.progress)
        with tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True, position=1) as bar:
            yield bar


def tick(bar: Any, versions: int = 1) -> None:
    """One step of a row's bar, which moved ``versions`` versions (the run's bar counts those)."""
    from .progress import advance

    advance(versions)
    if bar is not None:
        bar.update(1)
