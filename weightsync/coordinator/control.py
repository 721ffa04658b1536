"""One party's typed view of the coordinator: every control-plane operation is a method here.

A misspelled operation or argument therefore fails where it is written (an AttributeError or
TypeError in the caller, caught by any test that runs the line), not as a ``ProtocolError``
from the actor at run time. On the wire a call is the msgpack map
``{"op": <name>, "token": <session token>, "args": {"party": <id>, ...}}`` handled by the
actor's ``op_<name>`` (:mod:`weightsync.coordinator.actor`); replies that callers pick apart are
dataclasses built strictly from the reply map, so a reply that changed shape fails loudly.

Calls go through the party: a coordinator that restarted answers ``SessionLost``; the party
registers again (bringing what the coordinator lost) and the call is retried once. The
sender, the receivers and every transport reach the coordinator only through this class, so
rejoin works the same everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..errors import SessionLost
from .client import Coordinator


@dataclasses.dataclass(frozen=True)
class Publication:
    """What sender rank 0 fixes for the session: layout and transport."""

    manifest: list
    digest: str
    payload_bytes: int
    transport: str
    reason: str  # why this transport was chosen
    # the wire form of the transport's session record (transports/records.py): the coordinator
    # stores and forwards it unread; the receivers' transports parse it
    info: dict[str, Any]
    pipelined: bool = False  # see SenderTransport.pipelined
    keeps_versions: bool = False  # see SenderTransport.keeps_versions


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    manifest: list
    digest: str
    transport: str
    info: dict[str, Any]  # Publication.info, as published
    session: str


@dataclasses.dataclass(frozen=True)
class Target:
    """Which version a receiver should read next and where its bytes are (None: nothing yet)."""

    version: int | None
    state: str | None = None
    slot: int | None = None
    # the wire form of the version's record (transports/records.py), parts merged by the coordinator
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class VersionState:
    state: str
    reason: str
    info: dict[str, Any]


class ControlPlane:
    """``party()`` gives the party's current id; ``rejoin(stale_id)`` registers again after
    a coordinator restart (None: SessionLost reaches the caller)."""

    def __init__(self, coordinator: Coordinator, party: Callable[[], int],
                 rejoin: Callable[[int], None] | None = None):
        self.coordinator, self._party, self._rejoin = coordinator, party, rejoin

    def without_rejoin(self) -> ControlPlane:
        """For calls made while rejoining: a second SessionLost then reaches the caller."""
        return ControlPlane(self.coordinator, self._party)

    def _send(self, op: str, rpc_timeout: float | None = None, **args: Any) -> Any:
        party = self._party()
        try:
            return self.coordinator.rpc(op, rpc_timeout=rpc_timeout, party=party, **args)
        except SessionLost:
            if self._rejoin is None:
                raise
            self._rejoin(party)
            return self.coordinator.rpc(op, rpc_timeout=rpc_timeout, party=self._party(), **args)

    # -- every party ---------------------------------------------------------------------

    def heartbeat(self, rpc_timeout: float) -> None:
        self._send("heartbeat", rpc_timeout=rpc_timeout)

    def resource(self, kind: str, delta: int) -> None:
        """Open (+1) / close (-1) of a segment or handle, so leaks show in status()."""
        self._send("resource", kind=kind, delta=delta)

    def leave(self) -> None:
        self._send("leave")

    # -- sender --------------------------------------------------------------------------

    def receivers(self, count: int, timeout: float) -> list[dict[str, Any]]:
        """Wait until ``count`` receivers are registered; returns them by rank."""
        return self._send("receivers", count=count, timeout=timeout)

    def publish(self, publication: Publication) -> None:
        self._send("publish", **dataclasses.asdict(publication))

    def begin_stage(self, version: int) -> int:
        """Open ``version``; returns the storage slot it takes."""
        return self._send("begin_stage", version=version)["slot"]

    def stage_info(self, version: int, info: dict[str, Any], readable: bool = False) -> None:
        """More of ``version``'s info; ``readable``: receivers of a pipelined transport may
        start reading it (the sender is still writing)."""
        self._send("stage_info", version=version, info=info, readable=readable)

    def staged(self, version: int, info: dict[str, Any], stage_s: float) -> None:
        self._send("staged", version=version, info=info, stage_s=stage_s)

    def abort(self, version: int, reason: str) -> None:
        self._send("abort", version=version, reason=reason)

    def begin_sync(self, version: int) -> list[str]:
        """The barrier; returns the participants of ``version``."""
        return self._send("begin_sync", version=version)["participants"]

    def wait_outcome(self, version: int, timeout: float, info: dict[str, Any] | None = None) -> dict[str, Any]:
        """The committed version's metrics; raises SyncFailed naming each failed party.
        ``info``: more of the version's info first (as stage_info), in the same call."""
        if info is None:
            return self._send("wait_outcome", version=version, timeout=timeout)
        return self._send("wait_outcome", version=version, timeout=timeout, info=info)

    # -- receiver ------------------------------------------------------------------------

    def session(self, timeout: float) -> SessionInfo:
        return SessionInfo(**self._send("session", timeout=timeout))

    def verdict(self, accepted: bool, why: str = "") -> None:
        """The manifest check's outcome, before any byte moves."""
        self._send("verdict", accepted=accepted, why=why)

    def wait_version(self, version: int | None, timeout: float, wait: bool = True,
                     prefetch: bool = False, after: int | None = None, ahead: bool = False) -> Target:
        """``after``: only a version newer than it (and than the one served); ``ahead``: the
        caller is a receiver's ahead thread, ready to take versions before their barrier."""
        extra = {"after": after, "ahead": True} if ahead else {}
        return Target(**self._send("wait_version", version=version, timeout=timeout, wait=wait, prefetch=prefetch,
                                   **extra))

    def state(self, version: int) -> VersionState:
        return VersionState(**self._send("state", version=version))

    def report(self, version: int, ok: bool, serving: int | None, reason: str = "",
               metrics: dict[str, float] | None = None) -> None:
        self._send("report", version=version, ok=ok, serving=serving, reason=reason, metrics=metrics or {})

    def metrics(self, version: int) -> dict[str, Any]:
        """The version as status() shows it (participants, committed, failed, state)."""
        return self.coordinator.metrics(version)

    # -- broadcast transport: group membership (broadcast_groups.py) ---------------------------

    def bcast_form(self, version: int, ahead: bool = False) -> dict[str, Any]:
        """The group of ``version``; ``ahead``: formed in stage(), or ``{"ahead": False}`` where
        some live receiver is not ready to take it before the barrier."""
        return self._send("bcast_form", version=version, **({"ahead": True} if ahead else {}))

    def bcast_group(self, version: int, timeout: float) -> dict[str, Any]:
        return self._send("bcast_group", version=version, timeout=timeout)

    def bcast_check(self, version: int) -> dict[str, Any]:
        return self._send("bcast_check", version=version)

    def bcast_failed(self, version: int, error: str, timeout: float) -> str:
        """Returns the reason the version was aborted with, naming the party at fault."""
        return self._send("bcast_failed", version=version, error=error, timeout=timeout)["reason"]
