"""Wake-ups inside the coordinator actor: every op that changes state pokes, every op that
waits re-checks its condition after a poke or half a second, whichever comes first.

Kept apart from the actor so the pieces of the coordinator that wait (the actor's ops, the
broadcast membership ops) share one mechanism without importing each other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable


class Signals:
    """One event for "anything changed", one per version for "this version changed"."""

    def __init__(self) -> None:
        self.any = asyncio.Event()
        self._versions: dict[int, asyncio.Event] = {}

    def poke(self, versions: Iterable[int] = ()) -> None:
        # a set event is replaced, not cleared: a waiter that took the old one still wakes
        self.any.set()
        self.any = asyncio.Event()
        for v in versions:
            event = self._versions.pop(v, None)
            if event is not None:
                event.set()

    def version(self, version: int) -> asyncio.Event:
        return self._versions.setdefault(version, asyncio.Event())

    @staticmethod
    async def wait(event: asyncio.Event, deadline: float) -> None:
        """Until ``event`` is set, ``deadline`` passes, or half a second: callers loop."""
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            await asyncio.wait_for(event.wait(), timeout=min(left, 0.5))
        except asyncio.TimeoutError:
            pass
