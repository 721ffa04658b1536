"""Internal. What senders and receivers share: registration, heartbeats, the transport context, and the
log lines of a version's life.

Each party writes one line per version through :mod:`logging` (logger ``weightsync``): INFO when
it is done with the version, WARNING when it failed there, DEBUG per bucket. A job's logs then
tell which version each party served, what it cost and who failed, without a call to ``status()``.

    weightsync: sender trainer-0 v7 committed shm 1.17 GiB stage 0.210s barrier 0.034s receivers rollout-0,rollout-1
    weightsync: receiver rollout-1 v7 failed shm after 3/104 buckets 0.081s: ChecksumError: ...; rolled back to version 6
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

import ray

from .config import SyncConfig
from .coordinator import ops
from .coordinator.client import ControlPlane, Coordinator
from .device import describe, resolve
from .manifest import Manifest, plan_buckets
from .transports.base import TransportContext

log = logging.getLogger("weightsync")


def node_identity() -> tuple[str, str]:
    """(host address, Ray node id). Parties with equal node ids share a node (its /dev/shm, its
    devices); the host decides only without Ray (selection.on_one_node)."""
    if ray.is_initialized():
        try:
            return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        except Exception:
            pass
    return socket.gethostname(), ""


class Party:
    """A sender or receiver: built without touching the network, joined by :meth:`open`.
    A subclass sets every field it tells the coordinator (``_rejoin_state``) before it opens:
    registration and the heartbeat thread read them from the first call on."""

    role = "party"

    def __init__(self, coordinator: Coordinator, *, name: str, rank: int,
                 config: SyncConfig | None = None, device: str | None = None):
        self.coordinator = coordinator
        self.config = config or coordinator.config
        self.name, self.rank = name, rank
        self.device = resolve(device or self.config.device)
        self.host, self.node_id = node_identity()
        self._closed = False
        self._rejoin_lock = threading.Lock()
        self.control = ControlPlane(coordinator, lambda: self.party, self._rejoin)
        self.party: int | None = None  # set by open(): the coordinator's id for this party
        self.session: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def open(self) -> Party:
        """Register with the coordinator and start the heartbeat. Idempotent; WeightSender and
        WeightReceiver call it at the end of their constructors, so users never need to.

        Returns:
            This party.

        Raises:
            WeightSyncError: The coordinator is unreachable or refused the registration.
        """
        if self._beat is None:
            self._register()
            self._beat = threading.Thread(target=self._heartbeat, name=f"weightsync-heartbeat-{self.name}",
                                          daemon=True)
            self._beat.start()
        return self

    def _register(self) -> None:
        state = self._rejoin_state()
        if isinstance(state.get("served"), dict):
            state["served"] = ops.Served(**state["served"])
        reply = self.coordinator.call(ops.Register(
            role=self.role, name=self.name, rank=self.rank, host=self.host, os_pid=os.getpid(), node_id=self.node_id,
            device=ops.Device(**describe(self.device)), **state,
        ), rpc_timeout=self.config.connect_timeout_s)
        self.party: int = reply.party
        self.session: str = reply.session

    def _rejoin_state(self) -> dict[str, Any]:
        """What a restarted coordinator must learn from this party (fields of ops.Register)."""
        return {}

    def _rejoined(self) -> None:
        """Called after re-registering with a restarted coordinator."""

    def _rejoin(self, stale: int) -> None:
        """The coordinator restarted and lost the session: join again. Only the first thread
        to notice re-registers (heartbeat and caller race here)."""
        with self._rejoin_lock:
            if self.party == stale:
                self._register()
                self._rejoined()

    def _heartbeat(self) -> None:
        interval = self.config.heartbeat_interval_s
        while not self._stop.wait(interval):
            try:
                self.control.heartbeat(rpc_timeout=interval * 2)
            except Exception:
                pass  # the coordinator reports us silent if this keeps failing

    def _account(self, kind: str, delta: int) -> None:
        try:
            self.control.resource(kind, delta)
        except Exception:
            pass  # accounting must never break a transfer or a shutdown

    def _context(self, manifest: Manifest, digest: str) -> TransportContext:
        plan = plan_buckets(manifest, self.config.bucket_bytes, self.config.align_bytes)
        return TransportContext(
            config=self.config, plan=plan, manifest=manifest, digest=digest, session=self.session,
            name=self.name, rank=self.rank, device=self.device, account=self._account,
            control=self.control,
        )

    def _close_transport(self) -> None:
        pass

    def close(self) -> None:
        """Release transport resources and leave the session. Idempotent; a ``with`` block
        calls it on exit."""
        if self._closed:
            return
        self._closed = True
        self._close_transport()
        self._stop.set()
        if self.party is None:
            return  # never opened: the coordinator does not know it
        try:
            self.control.leave()
        except Exception:
            pass

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def log_sent(party: str, version: int, transport: str | None, nbytes: int, stage_s: float, barrier_s: float,
             committed: list[str]) -> None:
    log.info("sender %s v%d committed %s %s stage %.3fs barrier %.3fs receivers %s", party, version, transport,
             _size(nbytes), stage_s, barrier_s, ",".join(sorted(committed)) or "-")


def log_send_failed(party: str, version: int, transport: str | None, seconds: float, why: str) -> None:
    log.warning("sender %s v%d failed %s after %.3fs: %s", party, version, transport, seconds, why)


def log_applied(party: str, version: int, transport: str | None, nbytes: int, seconds: float) -> None:
    log.info("receiver %s v%d committed %s %s %.3fs", party, version, transport, _size(nbytes), seconds)


def log_apply_failed(party: str, version: int, transport: str | None, buckets: int, total: int, seconds: float,
                     why: str) -> None:
    log.warning("receiver %s v%d failed %s after %d/%d buckets %.3fs: %s", party, version, transport, buckets, total,
                seconds, why)


def log_bucket(party: str, version: int, index: int, nbytes: int) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s v%d bucket %d %s", party, version, index, _size(nbytes))
