"""Internal. A receiver's ahead thread (config ``receive_ahead``): takes each version as soon as the
sender makes it readable, while the engine still serves the version before, so that
``apply()`` at the barrier only loads, runs the post-load hook and resets the cache.

What "takes" means is the transport's (``ReceiverTransport.prefetch``): broadcast receives a
version sent in stage() into its shadow (transports/broadcast/ahead.py), shm verifies the
version's segment. On a device the transport issues that work on a stream of the shadow's own
(transports/shadow.py), not on this thread's current one, which on CUDA is the default stream
the engine generates on. The thread never touches the engine: a version that fails on its way in
fails in ``apply()``, which reports it, naming this receiver, and the engine keeps serving
what it served (all-or-nothing, as at the barrier).

The thread tells the coordinator it is there (``wait_version(ahead=True)``): a broadcast
sender sends a version ahead only when every live receiver has one, since a collective needs
every member in it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from .config import SyncConfig
from .coordinator.client import ControlPlane
from .errors import CapacityError, DeadlineExceeded
from .transports.base import ReceiverTransport

log = logging.getLogger("weightsync")

WAIT_S = 2.0  # one wait at the coordinator; also how long close() may wait for the thread


@dataclasses.dataclass(frozen=True)
class Receiving:
    """What the thread may use of its receiver (a ``WeightReceiver``, which builds this), and
    nothing else of it."""

    name: str
    config: SyncConfig
    control: ControlPlane
    transport: ReceiverTransport
    served: Callable[[], int | None]  # the version the engine serves
    check_aborted: Callable[[int], None]  # raises VersionError once the coordinator aborted that version


class AheadThread:
    """One per receiver session."""

    def __init__(self, receiver: Receiving, shadow_bytes: int):
        self.receiver, self.shadow_bytes = receiver, shadow_bytes
        self.taken: int | None = None  # the newest version taken (or tried) ahead
        self._outcome: tuple[int, bool] | None = None  # (version, it came in whole and verified)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weightsync-ahead-{receiver.name}", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, receiver: Receiving) -> AheadThread | None:
        """The thread, where config and transport allow it (None: versions come at the barrier).

        Raises:
            CapacityError: ``receive_ahead: on`` and the shadow does not fit; the receiver
                tells the coordinator it rejects the session, so every version names it.
        """
        config = receiver.config
        if config.receive_ahead == "off":
            return None
        try:
            nbytes = receiver.transport.open_ahead()
        except CapacityError as exc:
            if config.receive_ahead == "on":
                receiver.control.verdict(False, why=str(exc))
                raise
            log.info("weightsync %s: receive_ahead auto: versions at the barrier (%s)", receiver.name, exc)
            return None
        return None if nbytes is None else cls(receiver, nbytes)

    def _run(self) -> None:
        r = self.receiver
        while not self._stop.is_set():
            try:
                target = r.control.wait_version(None, WAIT_S, prefetch=True, after=self.taken, ahead=True)
            except DeadlineExceeded:
                continue  # nothing new yet
            except Exception:  # left the session, the coordinator restarts: the thread must live on,
                # since the coordinator counts it ready and a collective would wait for it
                if self._stop.wait(0.2):
                    return
                continue
            v = target.version
            if v is None or self._stop.is_set():
                continue
            self.taken = v
            ok = False
            try:
                info = r.transport.parse_version(target.info)
                ok = r.transport.prefetch(v, info, time.monotonic() + r.config.sync_timeout_s,
                                          lambda v=v: r.check_aborted(v))
            except Exception as exc:  # kept by the transport for apply(), which reports it
                log.info("weightsync %s: version %d failed on its way in ahead: %s: %s",
                         r.name, v, type(exc).__name__, exc)
            with self._cond:
                self._outcome = (v, ok)
                self._cond.notify_all()

    def wait(self, version: int | None, timeout: float) -> int | None:
        """``receiver.prefetch()`` with a thread running: wait until the thread is done with
        ``version`` (None: with one newer than the served one); that version if it came in
        whole, else None. Never a second reader beside the thread (a collective has one)."""
        floor = self.receiver.served()
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = self._outcome
                if got is not None and (got[0] >= version if version is not None else floor is None or got[0] > floor):
                    return got[0] if got[1] and (version is None or got[0] == version) else None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S + 1.0)
