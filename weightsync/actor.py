"""The coordinator actor: one named Ray actor per job. It never touches tensor bytes.

Parties (senders, receivers) talk to it through one ``rpc(bytes) -> bytes`` method carrying
msgpack ``{"op", "token", "args"}`` (see :mod:`weightsync.coordinator` for the client), present
the session token, and send heartbeats; a monitor task turns a silent party into an error that
names it. What a version may do next is decided by :class:`~weightsync.versions.VersionTable`;
this module adds the session registry, liveness, waits with deadlines and wake-ups.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import secrets
import time
from typing import Any

from . import errors, protocol
from .config import SyncConfig
from .errors import DeadlineExceeded, ManifestError, ProtocolError, SyncFailed, VersionError, WeightSyncError
from .membership import BroadcastGroups, Member, group_rank
from .slots import choose_slot, pinned_slots
from .versions import Candidate, State, Version, VersionTable


@dataclasses.dataclass
class PartyRecord:
    """What the coordinator knows of one registered party."""

    pid: int  # party id within the session
    name: str
    role: str  # "sender" | "receiver"
    rank: int
    host: str
    os_pid: int
    node_id: str
    device: dict[str, Any]
    last_seen: float
    alive: bool = True
    left: bool = False
    serving: int | None = None  # receivers: the version whose weights they hold, complete
    applying: int | None = None
    verdict: str | None = None  # receivers: None until they checked the manifest, "" if accepted
    why: str = ""
    # a dead party is named in the first version it fails; later versions go on without it
    # (until it comes back or is replaced) instead of failing again for the same reason
    reported_dead: bool = False

    @property
    def present(self) -> bool:
        return self.alive and not self.left

    @property
    def label(self) -> str:
        return f"{self.role} '{self.name}' (rank {self.rank}, pid {self.os_pid} on {self.host})"

    def public(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.role, "rank": self.rank, "host": self.host, "pid": self.os_pid,
            "alive": self.present, "left": self.left, "serving": self.serving,
            "applying": self.applying, "silent_s": round(now - self.last_seen, 3),
            "manifest": "pending" if self.verdict is None else ("accepted" if self.verdict == "" else "rejected"),
            "why": self.why,
        }


class CoordinatorActor:
    """The actor body. Use :class:`weightsync.Coordinator` to create or reach it."""

    def __init__(self, config: dict[str, Any], token: str):
        self.config = SyncConfig.from_mapping(config)
        self.token = token
        self.session = secrets.token_hex(8)
        self.parties: dict[int, PartyRecord] = {}
        self.table = VersionTable()
        self.bcast = BroadcastGroups()
        self.manifest: list[Any] | None = None
        self.digest: str | None = None
        self.payload_bytes = 0
        self.transport: str | None = None
        self.transport_reason = ""
        self.transport_info: dict[str, Any] = {}
        self.resources: dict[str, int] = {}
        self.changed = asyncio.Event()  # any party / session change; waiters re-check
        self._version_changed: dict[int, asyncio.Event] = {}
        # party ids carry the incarnation: after a restart, a party still holding an id from
        # before gets SessionLost and registers again, instead of passing for whoever took
        # that small number first in the new session
        self._next_pid = (int(self.session, 16) >> 32 << 20) + 1
        self._monitor: asyncio.Task | None = None

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
        now = time.monotonic()
        limit = self.config.heartbeat_timeout_s
        for p in self.parties.values():
            if p.present and now - p.last_seen > limit:
                p.alive = False
                p.why = f"silent for {now - p.last_seen:.1f}s (dead or stalled; heartbeat_timeout_s={limit})"
                self._party_lost(p)

    def _party_lost(self, p: PartyRecord) -> None:
        now = time.monotonic()
        if p.role == "sender" and p.rank == 0:
            hit = self.table.sender_lost(f"{p.label} {p.why}", bool(self.transport_info.get("keeps_versions")), now)
        elif p.role == "receiver":
            hit = self.table.receiver_lost(p.name, f"{p.label} {p.why}", now)
            p.reported_dead = p.reported_dead or bool(hit)
        else:
            hit = []
        self._poke(*hit)

    def _poke(self, *versions: Version) -> None:
        self.changed.set()
        self.changed = asyncio.Event()
        for v in versions:
            event = self._version_changed.pop(v.version, None)
            if event is not None:
                event.set()

    def _changed(self, version: int) -> asyncio.Event:
        return self._version_changed.setdefault(version, asyncio.Event())

    async def _wait(self, event: asyncio.Event, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            await asyncio.wait_for(event.wait(), timeout=min(left, 0.5))
        except asyncio.TimeoutError:
            pass

    def _party(self, pid: int) -> PartyRecord:
        p = self.parties.get(pid)
        if p is None:
            raise errors.SessionLost(f"party {pid} is not registered in this session (coordinator restarted?)")
        if p.left:
            raise ProtocolError(f"{p.label} is no longer in the session: {p.why}")
        p.last_seen = time.monotonic()
        if not p.alive:
            p.alive, p.why, p.reported_dead = True, "", False  # a stalled party came back (SIGCONT)
        return p

    def _named(self, role: str, name: str) -> PartyRecord | None:
        found = [p for p in self.parties.values() if p.role == role and p.name == name and not p.left]
        return found[-1] if found else None

    # -- registration and session --------------------------------------------------------

    async def op_register(self, role: str, name: str, rank: int, host: str, os_pid: int,
                          node_id: str = "", device: dict | None = None, last_version: int | None = None,
                          serving: int | None = None, served: dict | None = None) -> dict[str, Any]:
        """Join the session. A party re-registering after a coordinator restart brings what
        the coordinator lost: the newest version it staged (senders) or the version it
        serves and where its bytes are (receivers), so versions keep going up and rollback
        data stays pinned."""
        if role not in ("sender", "receiver"):
            raise ProtocolError(f"role must be 'sender' or 'receiver', got {role!r}")
        for other in list(self.parties.values()):
            if other.name == name and not other.left:
                # the newest registration wins: a restarted worker takes its name back at once
                # instead of waiting for its dead predecessor's heartbeat to time out
                other.left = True
                other.why = f"replaced by a new registration (pid {os_pid})"
                self._party_lost(other)
        pid = self._next_pid
        self._next_pid += 1
        record = PartyRecord(pid, name, role, int(rank), host, int(os_pid), node_id, device or {}, time.monotonic())
        self.parties[pid] = record
        if last_version is not None:
            self.table.raise_floor(int(last_version))
        if serving is not None:
            record.serving = int(serving)
            self.table.raise_floor(record.serving)
            if served is not None:
                self.table.restore_committed(record.serving, int(served.get("slot", 0)),
                                             dict(served.get("info") or {}), time.monotonic())
        self._poke()
        return {"party": pid, "session": self.session, "config": self.config.to_dict()}

    async def op_heartbeat(self, party: int) -> dict[str, Any]:
        self._party(party)
        return {}

    async def op_leave(self, party: int) -> dict[str, Any]:
        p = self.parties.get(party)
        if p is not None and not p.left:
            p.left, p.why = True, "left the session"
            self._party_lost(p)
        return {}

    async def op_publish(self, party: int, manifest: list, digest: str, payload_bytes: int,
                         transport: str, reason: str, info: dict) -> dict[str, Any]:
        self._party(party)
        if self.digest is not None and self.digest != digest:
            raise ManifestError(
                "the sender offers a different manifest than the one this session agreed; "
                "a new layout needs a new coordinator (a new session)"
            )
        self.manifest, self.digest, self.payload_bytes = manifest, digest, payload_bytes
        self.transport, self.transport_reason, self.transport_info = transport, reason, dict(info)
        self._poke()
        return {}

    async def op_session(self, party: int, timeout: float) -> dict[str, Any]:
        """Wait for the sender's manifest and transport choice."""
        deadline = time.monotonic() + timeout
        while self.manifest is None:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"no sender published a manifest within {timeout:.1f}s")
            self._party(party)
            await self._wait(self.changed, deadline)
        return {"manifest": self.manifest, "digest": self.digest, "transport": self.transport,
                "info": self.transport_info, "session": self.session}

    async def op_receivers(self, party: int, count: int, timeout: float) -> list[dict[str, Any]]:
        """Wait until ``count`` receivers are registered and alive; returns them by rank."""
        deadline = time.monotonic() + timeout
        while True:
            self._party(party)
            live = [p for p in self.parties.values() if p.role == "receiver" and p.present]
            if len(live) >= count:
                return [{"name": p.name, "rank": p.rank, "host": p.host, "node_id": p.node_id, "device": p.device}
                        for p in sorted(live, key=lambda p: p.rank)]
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"only {len(live)} of {count} receivers registered within {timeout:.1f}s: "
                    f"{sorted(p.name for p in live)}"
                )
            await self._wait(self.changed, deadline)

    async def op_verdict(self, party: int, accepted: bool, why: str = "") -> dict[str, Any]:
        p = self._party(party)
        p.verdict = "" if accepted else (why or "rejected")
        if not accepted:
            p.why = f"rejected the manifest: {why}"
        self._poke()
        return {}

    async def op_resource(self, party: int, kind: str, delta: int) -> dict[str, Any]:
        """Open/close accounting of segments and handles, so leaks show in status()."""
        self._party(party)
        self.resources[kind] = self.resources.get(kind, 0) + int(delta)
        return {}

    # -- versions: thin wrappers over the table, adding waits and wake-ups -----------------

    def _slot_for_new_version(self) -> int:
        served = {p.serving for p in self.parties.values() if p.role == "receiver" and p.present}
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

    async def op_stage_info(self, party: int, version: int, info: dict) -> dict[str, Any]:
        """Early per-version info (where the bytes will be), so pipelined receivers can start."""
        self._party(party)
        v = self.table[version]
        v.info.update(info)
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
        eligible = [p for p in self.parties.values()
                    if p.role == "receiver" and not p.left and not (p.reported_dead and not p.alive)]
        offered = [Candidate(p.name, f"{p.label} {p.why}" if not p.alive or p.verdict not in (None, "") else None)
                   for p in eligible]
        before = self.table.get(version)
        opening = before is not None and before.state in (State.STAGING, State.STAGED)
        v = self.table.begin_sync(version, offered, time.monotonic())
        if opening:
            for p in eligible:
                p.reported_dead = p.reported_dead or not p.alive  # named in this version, not again
        self._poke(v)
        return {"participants": v.participants}

    async def op_wait_version(self, party: int, version: int | None, timeout: float, wait: bool = True,
                              prefetch: bool = False) -> dict[str, Any]:
        """Receivers: wait until ``version`` (or, for None, anything newer than what they
        serve) can be read; returns where its bytes are. ``prefetch``: only to read ahead,
        the receiver is not applying it yet."""
        deadline = time.monotonic() + timeout
        while True:
            p = self._party(party)
            target = self.table.target_for(p.serving, version, pipelined=bool(self.transport_info.get("pipelined")),
                                           keeps_versions=bool(self.transport_info.get("keeps_versions")))
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
                sender = [s for s in self.parties.values() if s.role == "sender" and s.rank == 0]
                who = f"; sender: {sender[-1].label}{' ' + sender[-1].why if sender[-1].why else ''}" if sender else "; no sender registered"
                raise DeadlineExceeded(f"receiver '{p.name}' waited {timeout:.1f}s for {want}{who}")
            await self._wait(self._changed(version) if asked is not None else self.changed, deadline)

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

    async def op_wait_outcome(self, party: int, version: int, timeout: float) -> dict[str, Any]:
        self._party(party)
        deadline = time.monotonic() + timeout
        # trainer ranks other than 0 may get here before rank 0 began the version
        while version not in self.table:
            if time.monotonic() >= deadline or version <= self.table.floor:
                raise VersionError(f"version {version} was never staged (waited {timeout:.1f}s)")
            self._party(party)
            await self._wait(self.changed, deadline)
        v = self.table[version]
        while v.in_flight:
            self._party(party)
            if time.monotonic() >= deadline:
                self._poke(self.table.expire(version, timeout, time.monotonic()))
                break
            await self._wait(self._changed(version), deadline)
        out = v.public(self.payload_bytes)
        if v.state == State.ABORTED:
            raise SyncFailed(version, v.failed or {"sender": v.reason}, v.committed)
        return out

    # -- broadcast transport: collective group membership (see membership.py) --------------
    # Parties are named in these ops, since the transport has no party id.

    def _bcast_lost(self, v: Version, group: dict[str, Any], caller: str) -> list[str]:
        """Members of ``group`` (other than ``caller``) that died, left, or failed ``v``."""
        lost = []
        for role, name in [("sender", group["sender"])] + [("receiver", n) for n in group["members"]]:
            if name == caller:
                continue
            p = self._named(role, name)
            if p is None or p.pid != group["pids"].get(name, p.pid):
                lost.append(f"{role} '{name}' left the session")
            elif not p.alive:
                lost.append(f"{p.label} {p.why}")
            elif name in v.failed and not v.failed[name].startswith("version aborted"):
                lost.append(v.failed[name])
        return lost

    async def op_bcast_form(self, name: str, version: int) -> dict[str, Any]:
        """Sender rank 0, right after begin_sync: fix the group of ``version``."""
        v = self.table[version]
        if v.state == State.ABORTED:
            raise VersionError(f"version {version} was aborted: {v.reason}")
        sender = self._named("sender", name)
        if sender is None:
            raise ProtocolError(f"sender '{name}' is not in the session")
        members = [Member(p.name, p.pid, p.rank) for p in self.parties.values()
                   if p.role == "receiver" and p.present and p.name in v.participants and p.name not in v.failed]
        last = self.table.get(self.bcast.last) if self.bcast.last is not None else None
        group = self.bcast.form(version, Member(name, sender.pid), members,
                                last_failed=last is not None and last.state == State.ABORTED, nonce=self.session)
        v.info["group"] = {"epoch": group["epoch"], "members": group["members"]}  # shown in metrics
        self._poke(v)
        return group

    async def op_bcast_group(self, name: str, version: int, timeout: float) -> dict[str, Any]:
        """Receivers: wait for the group of ``version``; returns it with this receiver's rank."""
        deadline = time.monotonic() + timeout
        while self.bcast.get(version) is None:
            v = self.table[version]
            if v.state == State.ABORTED:
                raise VersionError(f"version {version} was aborted: {v.reason}")
            if v.state == State.COMMITTED:
                raise VersionError(f"version {version} committed without receiver '{name}' in its group")
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"receiver '{name}' waited {timeout:.1f}s for the sender to reach the "
                                       f"barrier of version {version}")
            await self._wait(self._changed(version), deadline)
        group = self.bcast.get(version)
        rank = group_rank(group, name)
        if rank is None:
            p = self._named("receiver", name)
            why = f" ({p.why})" if p is not None and p.why else ""
            raise VersionError(f"receiver '{name}' is not in the broadcast group of version {version}: it was not a "
                               f"live participant when the sender reached the barrier{why}; it joins the next version")
        return {**group, "rank": rank}

    async def op_bcast_check(self, name: str, version: int) -> dict[str, Any]:
        """Polled by a party whose collective is slow: is the version still on, and who is lost?"""
        v = self.table[version]
        group = self.bcast.get(version)
        lost = self._bcast_lost(v, group, name) if group is not None else []
        return {"aborted": v.reason if v.state == State.ABORTED else None, "lost": lost}

    async def op_bcast_failed(self, name: str, version: int, error: str, timeout: float) -> dict[str, Any]:
        """A member's collective failed: name the party at fault and abort ``version`` for
        everyone, so no member keeps waiting on a broken group. A killed peer shows up as a
        closed connection at once but as a silent party only after heartbeat_timeout_s, so
        this waits up to ``timeout`` for the monitor to name it."""
        v = self.table[version]
        group = self.bcast.get(version)
        deadline = time.monotonic() + timeout
        lost: list[str] = []
        while group is not None and v.state != State.ABORTED:
            lost = self._bcast_lost(v, group, name)
            if lost or time.monotonic() >= deadline:
                break
            await self._wait(self.changed, deadline)
        if v.state != State.ABORTED:
            epoch = f" (epoch {group['epoch']})" if group else ""
            why = "lost " + "; ".join(lost) if lost else f"failed on '{name}': {error}"
            if not self.table.abort(version, f"broadcast group{epoch} {why}", time.monotonic()):
                return {"reason": f"broadcast group{epoch} {why}"}
            self._poke(v)
        return {"reason": v.reason}

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
            "manifest_tensors": len(self.manifest or ()), "payload_bytes": self.payload_bytes,
            "latest_committed": self.table.latest_committed,
            "parties": [p.public(now) for p in sorted(self.parties.values(), key=lambda p: (p.role, p.rank, p.pid))
                        if not p.left],
            "versions": [v.public(self.payload_bytes) for v in self.table.recent(20)],
            "resources": dict(self.resources),
            "config": self.config.to_dict(),
        }

    async def op_metrics(self, version: int) -> dict[str, Any]:
        return self.table[version].public(self.payload_bytes)
