"""The coordinator actor: one named Ray actor per job. It never touches tensor bytes.

Parties (senders, receivers) talk to it through one ``rpc(bytes) -> bytes`` method carrying
msgpack ``{"op", "token", "args"}`` (see :mod:`weightsync.coordinator.client` for the client), present
the session token, and send heartbeats; a monitor task turns a silent party into an error that
names it. What a version may do next is decided by :class:`~weightsync.coordinator.versions.VersionTable`;
this module adds the session registry, liveness, waits with deadlines and wake-ups.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from typing import Any

from ..config import SyncConfig
from ..errors import DeadlineExceeded, ManifestError, ProtocolError, SyncFailed, VersionError, WeightSyncError
from . import protocol
from .membership import BroadcastGroups
from .membership_ops import BroadcastMembership
from .roster import Parties, PartyRecord
from .signals import Signals
from .versions import Candidate, State, Version, VersionTable, choose_slot, pinned_slots


class CoordinatorActor:
    """The actor body. Use :class:`weightsync.Coordinator` to create or reach it."""

    def __init__(self, config: dict[str, Any], token: str):
        self.config = SyncConfig.from_mapping(config)
        self.token = token
        self.session = secrets.token_hex(8)
        # party ids carry the incarnation: after a restart, a party still holding an id from
        # before gets SessionLost and registers again, instead of passing for whoever took
        # that small number first in the new session
        self.parties = Parties(first_pid=(int(self.session, 16) >> 32 << 20) + 1)
        self.table = VersionTable()
        self.bcast = BroadcastGroups()
        self.manifest: list[Any] | None = None
        self.digest: str | None = None
        self.payload_bytes = 0
        self.transport: str | None = None
        self.transport_reason = ""
        self.transport_info: dict[str, Any] = {}  # the transport's own, for receivers only
        self.pipelined = self.keeps_versions = False  # the transport's traits (SenderTransport)
        self.resources: dict[str, int] = {}
        self.signals = Signals()
        self.broadcast = BroadcastMembership(self.table, self.parties, self.bcast, self.signals, self.session)
        self._monitor: asyncio.Task | None = None
        # control-plane calls served, by op: status() shows them, so the calls one version
        # costs can be counted (docs/benchmarks.md)
        self.calls: dict[str, int] = {}

    # -- the one entry point -------------------------------------------------------------

    async def rpc(self, payload: bytes) -> bytes:
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())
        try:
            msg = protocol.decode(payload)
            if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
                raise ProtocolError("control message must be a map with an 'op'")
            if not hmac.compare_digest(str(msg.get("token", "")), self.token):
                raise ProtocolError(f"op {msg['op']!r} refused: wrong session token for coordinator")
            handler = getattr(self, "op_" + msg["op"], None)
            if handler is None:
                raise ProtocolError(f"unknown op {msg['op']!r}")
            self.calls[msg["op"]] = self.calls.get(msg["op"], 0) + 1
            args = msg.get("args") or {}
            if not isinstance(args, dict):
                raise ProtocolError("'args' must be a map")
            result = await handler(**args)
            return protocol.encode({"ok": True, "result": result})
        except WeightSyncError as exc:
            kind = type(exc).__name__
            extra = {"failed": exc.failed, "committed": exc.committed, "version": exc.version} if isinstance(exc, SyncFailed) else {}
            return protocol.encode({"ok": False, "kind": kind, "error": str(exc), **extra})
        except TypeError as exc:
            return protocol.encode({"ok": False, "kind": "ProtocolError", "error": f"bad arguments: {exc}"})

    # -- liveness ------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(0.25, self.config.heartbeat_interval_s))
            self._check_liveness()

    def _check_liveness(self) -> None:
        for p in self.parties.silent(time.monotonic(), self.config.heartbeat_timeout_s):
            self._party_lost(p)

    def _party_lost(self, p: PartyRecord) -> None:
        now = time.monotonic()
        if p.role == "sender" and p.rank == 0:
            hit = self.table.sender_lost(f"{p.label} {p.why}", self.keeps_versions, now)
        elif p.role == "receiver":
            hit = self.table.receiver_lost(p.name, f"{p.label} {p.why}", now)
            p.reported_dead = p.reported_dead or bool(hit)
        else:
            hit = []
        self._poke(*hit)

    def _poke(self, *versions: Version) -> None:
        self.signals.poke(v.version for v in versions)

    def _party(self, pid: int, seen: bool = True) -> PartyRecord:
        return self.parties.touch(pid, time.monotonic(), seen)

    # -- broadcast membership (coordinator_broadcast.py) -----------------------------------------

    async def op_bcast_form(self, party: int, version: int, ahead: bool = False) -> dict[str, Any]:
        return await self.broadcast.form(self._party(party), version, ahead)

    async def op_bcast_group(self, party: int, version: int, timeout: float) -> dict[str, Any]:
        return await self.broadcast.group(self._party(party), version, timeout)

    async def op_bcast_check(self, party: int, version: int) -> dict[str, Any]:
        return await self.broadcast.check(self._party(party), version)

    async def op_bcast_failed(self, party: int, version: int, error: str, timeout: float) -> dict[str, Any]:
        return await self.broadcast.failed(self._party(party), version, error, timeout)

    # -- registration and session --------------------------------------------------------

    async def op_register(self, role: str, name: str, rank: int, host: str, os_pid: int,
                          node_id: str = "", device: dict | None = None, last_version: int | None = None,
                          serving: int | None = None, served: dict | None = None) -> dict[str, Any]:
        """Join the session. A party re-registering after a coordinator restart brings what
        the coordinator lost: the newest version it staged (senders) or the version it
        serves and where its bytes are (receivers), so versions keep going up and rollback
        data stays pinned."""
        record, replaced = self.parties.add(role, name, rank, host, os_pid, node_id, device or {}, time.monotonic())
        for other in replaced:
            self._party_lost(other)
        if last_version is not None:
            self.table.raise_floor(int(last_version))
        if serving is not None:
            record.serving = int(serving)
            self.table.raise_floor(record.serving)
            if served is not None:
                self.table.restore_committed(record.serving, int(served.get("slot", 0)),
                                             dict(served.get("info") or {}), time.monotonic())
        self._poke()
        return {"party": record.pid, "session": self.session, "config": self.config.to_dict()}

    async def op_heartbeat(self, party: int) -> dict[str, Any]:
        self._party(party)
        return {}

    async def op_leave(self, party: int) -> dict[str, Any]:
        p = self.parties.leave(party)
        if p is not None:
            self._party_lost(p)
        return {}

    async def op_publish(self, party: int, manifest: list, digest: str, payload_bytes: int,
                         transport: str, reason: str, info: dict, pipelined: bool = False,
                         keeps_versions: bool = False) -> dict[str, Any]:
        self._party(party)
        if self.digest is not None and self.digest != digest:
            raise ManifestError(
                "the sender offers a different manifest than the one this session agreed; "
                "a new layout needs a new coordinator (a new session)"
            )
        self.manifest, self.digest, self.payload_bytes = manifest, digest, payload_bytes
        self.transport, self.transport_reason, self.transport_info = transport, reason, dict(info)
        self.pipelined, self.keeps_versions = bool(pipelined), bool(keeps_versions)
        self._poke()
        return {}

    async def op_session(self, party: int, timeout: float) -> dict[str, Any]:
        """Wait for the sender's manifest and transport choice."""
        deadline = time.monotonic() + timeout
        while self.manifest is None:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"no sender published a manifest within {timeout:.1f}s")
            self._party(party, seen=False)
            await self.signals.wait(self.signals.any, deadline)
        return {"manifest": self.manifest, "digest": self.digest, "transport": self.transport,
                "info": self.transport_info, "session": self.session}

    async def op_receivers(self, party: int, count: int, timeout: float) -> list[dict[str, Any]]:
        """Wait until ``count`` receivers are registered and alive; returns them by rank."""
        deadline = time.monotonic() + timeout
        self._party(party)
        while True:
            self._party(party, seen=False)
            live = self.parties.receivers()
            if len(live) >= count:
                # serving: a delta sender sends full unless every receiver holds its base
                return [{"name": p.name, "rank": p.rank, "host": p.host, "node_id": p.node_id, "device": p.device,
                         "serving": p.serving} for p in live]
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"only {len(live)} of {count} receivers registered within {timeout:.1f}s: "
                    f"{sorted(p.name for p in live)}"
                )
            await self.signals.wait(self.signals.any, deadline)

    async def op_verdict(self, party: int, accepted: bool, why: str = "") -> dict[str, Any]:
        p = self._party(party)
        p.verdict = "" if accepted else (why or "rejected")
        if not accepted:
            p.why = f"rejected the manifest: {why}"
            # a barrier that began before the check came back counted this receiver in: fail
            # those versions now, naming it, instead of waiting for a report that never comes
            for v in self.table.receiver_lost(p.name, f"{p.label} {p.why}", time.monotonic()):
                self._poke(v)
        self._poke()
        return {}

    async def op_resource(self, party: int, kind: str, delta: int) -> dict[str, Any]:
        """Open/close accounting of segments and handles, so leaks show in status()."""
        self._party(party)
        self.resources[kind] = self.resources.get(kind, 0) + int(delta)
        return {}

    # -- versions: thin wrappers over the table, adding waits and wake-ups -----------------

    def _slot_for_new_version(self) -> int:
        served = {p.serving for p in self.parties.receivers()}
        pinned = pinned_slots(self.table, served, self.config.keep_previous)
        latest = self.table.latest_committed
        return choose_slot(pinned, self.config.shm_max_segments,
                           self.table.versions[latest].slot if latest is not None else None)

    async def op_begin_stage(self, party: int, version: int) -> dict[str, Any]:
        p = self._party(party)
        if p.role != "sender" or p.rank != 0:
            raise ProtocolError(f"{p.label} may not stage versions; only sender rank 0 does")
        v, superseded = self.table.begin_stage(version, self._slot_for_new_version, time.monotonic())
        self._poke(v, *superseded)
        return {"slot": v.slot}

    async def op_stage_info(self, party: int, version: int, info: dict, readable: bool = False) -> dict[str, Any]:
        """More per-version info (where the bytes are, the digest once known); ``readable``:
        a pipelined sender announced the version, receivers may start reading it."""
        self._party(party)
        v = self.table[version]
        v.info.update(info)
        v.readable = v.readable or bool(readable)
        self._poke(v)
        return {}

    async def op_staged(self, party: int, version: int, info: dict, stage_s: float) -> dict[str, Any]:
        self._party(party)
        self._poke(self.table.staged(version, info, stage_s))
        return {}

    async def op_abort(self, party: int, version: int, reason: str) -> dict[str, Any]:
        p = self._party(party)
        if self.table.abort(version, f"{p.label}: {reason}", time.monotonic()):
            self._poke(self.table[version])
        return {}

    async def op_begin_sync(self, party: int, version: int) -> dict[str, Any]:
        self._party(party)
        eligible = self.parties.at_barrier()
        ahead = self.bcast.get(version) if self.table.get(version) is not None else None
        if ahead is not None and self.table[version].state in (State.STAGING, State.STAGED):
            # its bytes moved before the barrier, to this group: a receiver that joined since
            # takes the next version (as one that joins after a barrier does)
            eligible = [p for p in eligible if p.name in ahead["members"]]
        offered = [Candidate(p.name, f"{p.label} {p.why}" if not p.alive or p.rejected else None) for p in eligible]
        before = self.table.get(version)
        opening = before is not None and before.state in (State.STAGING, State.STAGED)
        v = self.table.begin_sync(version, offered, time.monotonic())
        if opening:
            for p in eligible:
                p.reported_dead = p.reported_dead or not p.alive  # named in this version, not again
        self._poke(v)
        return {"participants": v.participants}

    async def op_wait_version(self, party: int, version: int | None, timeout: float, wait: bool = True,
                              prefetch: bool = False, after: int | None = None,
                              ahead: bool = False) -> dict[str, Any]:
        """Receivers: wait until ``version`` (or, for None, anything newer than what they
        serve) can be read; returns where its bytes are. ``prefetch``: only to read ahead,
        the receiver is not applying it yet. ``after``: nothing at or below it (what an ahead
        thread took already); ``ahead``: the caller is an ahead thread (receive_ahead.py)."""
        p = self._party(party)
        if ahead and not p.ahead:
            p.ahead = True
            self._poke()
        deadline = time.monotonic() + timeout
        while True:
            p = self._party(party, seen=False)
            floor = p.serving if after is None else after if p.serving is None else max(after, p.serving)
            target = self.table.target_for(floor, version, pipelined=self.pipelined,
                                           keeps_versions=self.keeps_versions)
            if target is not None:
                v = self.table[target]
                if not prefetch:
                    p.applying = target
                return {"version": target, "state": v.state.value, "slot": v.slot, "info": v.info}
            asked = self.table.get(version) if version is not None else None
            if asked is not None and asked.state == State.ABORTED:
                raise VersionError(f"version {version} was aborted: {asked.reason}")
            if not wait and (version is None or asked is not None):
                return {"version": None}
            if time.monotonic() >= deadline:
                want = f"version {version}" if version is not None else "a version newer than the one served"
                s0 = self.parties.sender0()
                who = f"; sender: {s0.label}{' ' + s0.why if s0.why else ''}" if s0 else "; no sender registered"
                raise DeadlineExceeded(f"receiver '{p.name}' waited {timeout:.1f}s for {want}{who}")
            await self.signals.wait(self.signals.version(version) if asked is not None else self.signals.any, deadline)

    async def op_state(self, party: int, version: int) -> dict[str, Any]:
        self._party(party)
        v = self.table[version]
        return {"state": v.state.value, "reason": v.reason, "info": v.info}

    async def op_report(self, party: int, version: int, ok: bool, serving: int | None,
                        reason: str = "", metrics: dict | None = None) -> dict[str, Any]:
        p = self._party(party)
        p.serving, p.applying = serving, None
        v = self.table.report(version, p.name, ok, f"{p.label}: {reason}", metrics or {}, time.monotonic())
        if v is not None:
            self._poke(v)
        self._poke()
        return {}

    async def op_wait_outcome(self, party: int, version: int, timeout: float,
                              info: dict | None = None) -> dict[str, Any]:
        """Wait until ``version`` committed or failed; ``info``: a sender's late stage_info
        (the digest of a transport that packs at the barrier), folded into this call."""
        self._party(party)
        deadline = time.monotonic() + timeout
        # trainer ranks other than 0 may get here before rank 0 began the version
        while version not in self.table:
            if time.monotonic() >= deadline or version <= self.table.floor:
                raise VersionError(f"version {version} was never staged (waited {timeout:.1f}s)")
            self._party(party, seen=False)
            await self.signals.wait(self.signals.any, deadline)
        v = self.table[version]
        if info:
            v.info.update(info)
            self._poke(v)
        while v.in_flight:
            self._party(party, seen=False)
            if time.monotonic() >= deadline:
                self._poke(self.table.expire(version, timeout, time.monotonic()))
                break
            await self.signals.wait(self.signals.version(version), deadline)
        out = v.public(self.payload_bytes)
        if v.state == State.ABORTED:
            raise SyncFailed(version, v.failed or {"sender": v.reason}, v.committed)
        return out

    # -- staleness (one-step-off) --------------------------------------------------------

    async def op_check_batch(self, party: int, batch_version: int, step: int,
                             max_staleness: int | None = None) -> dict[str, Any]:
        from .staleness import check_staleness

        limit = self.config.max_staleness if max_staleness is None else max_staleness
        check_staleness(batch_version, step, limit)
        return {"lag": step - batch_version}

    # -- reading -------------------------------------------------------------------------

    async def op_status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "session": self.session,
            "transport": self.transport, "transport_reason": self.transport_reason,
            # the transport reads a version's tensors in stage(): staging early frees the barrier
            "pipelined": self.pipelined,
            "group": {k: self.transport_info[k] for k in ("backend", "communicator", "communicator_reason")
                      if k in self.transport_info},
            "manifest_tensors": len(self.manifest or ()), "payload_bytes": self.payload_bytes,
            "latest_committed": self.table.latest_committed,
            "parties": self.parties.public(now),
            "versions": [v.public(self.payload_bytes) for v in self.table.recent(20)],
            "resources": dict(self.resources),
            "calls": dict(self.calls),
            "config": self.config.to_dict(),
        }

    async def op_metrics(self, version: int) -> dict[str, Any]:
        return self.table[version].public(self.payload_bytes)
