"""One party's typed view of the coordinator: every control-plane operation is a method here.

A misspelled operation or argument therefore fails where it is written (an AttributeError or
TypeError in the caller, caught by any test that runs the line), not as a ``ProtocolError``
from the actor at run time. Each call sends one request record of :mod:`weightsync.coordinator.ops` and
gets back its reply record, decoded strictly, so a reply that changed shape fails loudly.

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
from . import ops
from .client import Coordinator
from .ops import Publication, SessionInfo, Target, VersionState

__all__ = ["ControlPlane", "Publication", "SessionInfo", "Target", "VersionState"]


class ControlPlane:
    """``party()`` gives the party's current id; ``rejoin(stale_id)`` registers again after
    a coordinator restart (None: SessionLost reaches the caller)."""

    def __init__(self, coordinator: Coordinator, party: Callable[[], int],
                 rejoin: Callable[[int], None] | None = None):
        self.coordinator, self._party, self._rejoin = coordinator, party, rejoin

    def without_rejoin(self) -> ControlPlane:
        """For calls made while rejoining: a second SessionLost then reaches the caller."""
        return ControlPlane(self.coordinator, self._party)

    def _send(self, request: Any, rpc_timeout: float | None = None) -> Any:
        """``request``'s reply; its ``party`` field is this party's id, replaced by the new
        one when the call is retried after a rejoin."""
        try:
            return self.coordinator.call(request, rpc_timeout=rpc_timeout)
        except SessionLost:
            if self._rejoin is None:
                raise
            self._rejoin(request.party)
            return self.coordinator.call(dataclasses.replace(request, party=self._party()), rpc_timeout=rpc_timeout)

    # -- every party ---------------------------------------------------------------------

    def heartbeat(self, rpc_timeout: float) -> None:
        self._send(ops.Heartbeat(party=self._party()), rpc_timeout=rpc_timeout)

    def resource(self, kind: str, delta: int) -> None:
        """Open (+1) / close (-1) of a segment or handle, so leaks show in status()."""
        self._send(ops.Resource(party=self._party(), kind=kind, delta=delta))

    def leave(self) -> None:
        self._send(ops.Leave(party=self._party()))

    # -- sender --------------------------------------------------------------------------

    def receivers(self, count: int, timeout: float) -> list[ops.Placement]:
        """Wait until ``count`` receivers are registered; returns them by rank."""
        return self._send(ops.Receivers(party=self._party(), count=count, timeout=timeout)).receivers

    def publish(self, publication: Publication) -> None:
        self._send(ops.Publish(party=self._party(), publication=publication))

    def begin_stage(self, version: int) -> int:
        """Open ``version``; returns the storage slot it takes."""
        return self._send(ops.BeginStage(party=self._party(), version=version)).slot

    def stage_info(self, version: int, info: dict[str, Any], readable: bool = False) -> None:
        """More of ``version``'s info; ``readable``: receivers of a pipelined transport may
        start reading it (the sender is still writing)."""
        self._send(ops.StageInfo(party=self._party(), version=version, info=info, readable=readable))

    def staged(self, version: int, info: dict[str, Any], stage_s: float) -> None:
        self._send(ops.Staged(party=self._party(), version=version, info=info, stage_s=stage_s))

    def abort(self, version: int, reason: str) -> None:
        self._send(ops.Abort(party=self._party(), version=version, reason=reason))

    def begin_sync(self, version: int) -> list[str]:
        """The barrier; returns the participants of ``version``."""
        return self._send(ops.BeginSync(party=self._party(), version=version)).participants

    def wait_outcome(self, version: int, timeout: float, info: dict[str, Any] | None = None) -> ops.Metrics:
        """The committed version's metrics; raises SyncFailed naming each failed party.
        ``info``: more of the version's info first (as stage_info), in the same call."""
        return self._send(ops.WaitOutcome(party=self._party(), version=version, timeout=timeout, info=info))

    # -- receiver ------------------------------------------------------------------------

    def session(self, timeout: float) -> SessionInfo:
        return self._send(ops.Session(party=self._party(), timeout=timeout))

    def verdict(self, accepted: bool, why: str = "") -> None:
        """The manifest check's outcome, before any byte moves."""
        self._send(ops.Verdict(party=self._party(), accepted=accepted, why=why))

    def wait_version(self, version: int | None, timeout: float, wait: bool = True,
                     prefetch: bool = False, after: int | None = None, ahead: bool = False) -> Target:
        """``after``: only a version newer than it (and than the one served); ``ahead``: the
        caller is a receiver's ahead thread, ready to take versions before their barrier."""
        return self._send(ops.WaitVersion(party=self._party(), version=version, timeout=timeout, wait=wait,
                                          prefetch=prefetch, after=after if ahead else None, ahead=ahead))

    def state(self, version: int) -> VersionState:
        return self._send(ops.State(party=self._party(), version=version))

    def report(self, version: int, ok: bool, serving: int | None, reason: str = "",
               metrics: dict[str, ops.Scalar] | None = None) -> None:
        self._send(ops.Report(party=self._party(), version=version, ok=ok, serving=serving, reason=reason,
                              metrics=metrics or {}))

    def metrics(self, version: int) -> ops.Metrics:
        """The version as status() shows it (participants, committed, failed, state)."""
        return self.coordinator.call(ops.GetMetrics(version=version))

    # -- broadcast transport: group membership (broadcast_groups.py) ---------------------------

    def bcast_form(self, version: int, ahead: bool = False) -> ops.BroadcastGroup | None:
        """The group of ``version``; ``ahead``: formed in stage(), or None where some live
        receiver is not ready to take it before the barrier."""
        return self._send(ops.BcastForm(party=self._party(), version=version, ahead=ahead)).group

    def bcast_group(self, version: int, timeout: float) -> ops.BroadcastGroup:
        """The group of ``version`` once formed, with this receiver's rank."""
        return self._send(ops.BcastGroup(party=self._party(), version=version, timeout=timeout))

    def bcast_check(self, version: int) -> ops.GroupCheck:
        return self._send(ops.BcastCheck(party=self._party(), version=version))

    def bcast_failed(self, version: int, error: str, timeout: float) -> str:
        """Returns the reason the version was aborted with, naming the party at fault."""
        return self._send(ops.BcastFailed(party=self._party(), version=version, error=error, timeout=timeout)).reason
