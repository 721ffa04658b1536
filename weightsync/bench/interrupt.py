"""Stopping the benchmark when asked (Ctrl-C), and the progress bars it draws meanwhile.

Ctrl-C raised KeyboardInterrupt in the driver's ``ray.get``, and the rows' ``finally`` blocks
then asked every actor to close its session: calls queued behind the version the actor was
still in (one call at a time per actor), each waited up to ROW_TIMEOUT_S (600 s). So the
benchmark sat for minutes after Ctrl-C, while SIGTERM (no handler: the process just dies, Ray
reaps its workers) stopped it at once. Now an interrupted run kills its actors without asking
them anything, waits for their processes, and unlinks the segment files they left.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import psutil
import ray

from ..config import SyncConfig
from ..transports.segment_scan import reap_stale

# the exit status of a process stopped by SIGINT, as a shell reports it
INTERRUPTED = 130


def interrupt_close(actors: list[Any], pids: list[int]) -> None:
    """After Ctrl-C: kill every actor without asking it anything, wait (briefly) for their
    processes to exit and unlink the segment files they left (their creator is gone)."""
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    psutil.wait_procs(procs, timeout=30)
    reap_stale(SyncConfig.from_env().shm_dir)


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
        with tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
            yield bar


def tick(bar: Any) -> None:
    if bar is not None:
        bar.update(1)
