"""The coordinator: one named Ray actor per job that owns the version state machine.

It never touches tensor bytes. Parties (senders, receivers) talk to it through a single
``rpc(bytes) -> bytes`` method carrying msgpack, present the session token, and send
heartbeats; a monitor task turns a silent party into an error that names it.

Version states (DESIGN.md): STAGING -> STAGED -> TRANSFERRING -> COMMITTED | ABORTED(reason).
STAGING is the sender still writing; receivers of a pipelined transport may already read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import secrets
import time
from typing import Any

import ray

from . import errors, protocol
from .config import SyncConfig
from .errors import DeadlineExceeded, ManifestError, ProtocolError, SyncFailed, VersionError, WeightSyncError

STAGING, STAGED, TRANSFERRING, COMMITTED, ABORTED = "STAGING", "STAGED", "TRANSFERRING", "COMMITTED", "ABORTED"
IN_FLIGHT = (STAGING, STAGED, TRANSFERRING)
_ERRORS = {n: c for n, c in vars(errors).items() if isinstance(c, type) and issubclass(c, WeightSyncError)}


@dataclasses.dataclass
class Party:
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

    def public(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.role, "rank": self.rank, "host": self.host, "pid": self.os_pid,
            "alive": self.alive and not self.left, "left": self.left, "serving": self.serving,
            "applying": self.applying, "silent_s": round(now - self.last_seen, 3),
            "manifest": "pending" if self.verdict is None else ("accepted" if self.verdict == "" else "rejected"),
            "why": self.why,
        }


@dataclasses.dataclass
class Version:
    version: int
    state: str
    slot: int
    started: float
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    participants: list[str] = dataclasses.field(default_factory=list)
    committed: list[str] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    reason: str = ""
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    receivers: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    sync_started: float | None = None
    finished: float | None = None
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def public(self, payload_bytes: int) -> dict[str, Any]:
        out = {
            "version": self.version, "state": self.state, "slot": self.slot, "reason": self.reason,
            "participants": list(self.participants), "committed": list(self.committed),
            "failed": dict(self.failed), "phases_s": dict(self.phases), "receivers": dict(self.receivers),
            "bytes": payload_bytes, "info": dict(self.info),
            # whole-version digests (docs/digest.md): the sender's and each receiver's, equal
            # when they hold the same bytes; None with digests off
            "digest": self.info.get("digest"),
            "receiver_digests": {n: m.get("digest") for n, m in self.receivers.items()},
        }
        if self.finished is not None and self.sync_started is not None:
            barrier = self.finished - self.sync_started
            out["barrier_s"] = barrier
            total = self.phases.get("stage_s", 0.0) + barrier
            out["gbps"] = payload_bytes / total / 1e9 if total > 0 else None
        return out


class CoordinatorActor:
    """The actor body. Use :class:`Coordinator` to create or reach it."""

    def __init__(self, config: dict[str, Any], token: str, expected_receivers: int | None = None):
        self.config = SyncConfig.from_mapping(config)
        self.token = token
        self.session = secrets.token_hex(8)
        self.expected_receivers = expected_receivers
        self.parties: dict[int, Party] = {}
        self.versions: dict[int, Version] = {}
        self.manifest: list[Any] | None = None
        self.digest: str | None = None
        self.payload_bytes = 0
        self.transport: str | None = None
        self.transport_reason = ""
        self.transport_info: dict[str, Any] = {}
        self.resources: dict[str, int] = {}
        self.latest_committed: int | None = None
        self.floor = -1  # versions at or below this were used before a coordinator restart
        self.batches: list[dict[str, Any]] = []
        self.changed = asyncio.Event()  # any party / session change; waiters re-check
        # party ids carry the incarnation: after a restart, a party still holding an id from
        # before gets SessionLost and registers again, instead of passing for whoever took
        # that small number first in the new session
        self._next_pid = (int(self.session, 16) >> 32 << 20) + 1
        self._monitor: asyncio.Task | None = None
        self.created = time.time()

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
            if p.alive and not p.left and now - p.last_seen > limit:
                p.alive = False
                p.why = f"silent for {now - p.last_seen:.1f}s (dead or stalled; heartbeat_timeout_s={limit})"
                self._party_lost(p)

    def _party_lost(self, p: Party) -> None:
        label = self._label(p)
        for v in self.versions.values():
            if v.state not in IN_FLIGHT:
                continue
            if p.role == "sender" and p.rank == 0:
                # a version still being written can never complete; one fully staged in
                # storage (shm) can, and is settled by the receivers' reports; on a streaming
                # transport the bytes die with the sender
                if v.state == STAGING or not self.transport_info.get("keeps_versions"):
                    self._abort(v, f"{label} {p.why}")
            elif p.name in v.participants and p.name not in v.committed and p.name not in v.failed:
                v.failed[p.name] = f"{label} {p.why}"
                p.reported_dead = True
                self._maybe_finish(v)
        self._poke()

    def _label(self, p: Party) -> str:
        return f"{p.role} '{p.name}' (rank {p.rank}, pid {p.os_pid} on {p.host})"

    def _poke(self, v: Version | None = None) -> None:
        self.changed.set()
        self.changed = asyncio.Event()
        if v is not None:
            v.changed.set()
            v.changed = asyncio.Event()

    async def _wait(self, event: asyncio.Event, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            await asyncio.wait_for(event.wait(), timeout=min(left, 0.5))
        except asyncio.TimeoutError:
            pass

    def _party(self, pid: int) -> Party:
        p = self.parties.get(pid)
        if p is None:
            raise errors.SessionLost(f"party {pid} is not registered in this session (coordinator restarted?)")
        if p.left:
            raise ProtocolError(f"{self._label(p)} is no longer in the session: {p.why}")
        p.last_seen = time.monotonic()
        if not p.alive and not p.left:
            p.alive, p.why, p.reported_dead = True, "", False  # a stalled party came back (SIGCONT)
        return p

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
        self.parties[pid] = Party(pid, name, role, int(rank), host, int(os_pid), node_id, device or {}, time.monotonic())
        if last_version is not None:
            self.floor = max(self.floor, int(last_version))
        if serving is not None:
            self.parties[pid].serving = int(serving)
            self.floor = max(self.floor, int(serving))
            if serving not in self.versions and served is not None:
                self.versions[serving] = Version(serving, COMMITTED, int(served.get("slot", 0)), time.monotonic(),
                                                 info=dict(served.get("info") or {}))
                if self.latest_committed is None or serving > self.latest_committed:
                    self.latest_committed = serving
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
            live = [p for p in self.parties.values() if p.role == "receiver" and p.alive and not p.left]
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

    # -- the version state machine -------------------------------------------------------

    def _pinned_slots(self) -> set[int]:
        keep = {v.slot for v in self.versions.values() if v.state in IN_FLIGHT}
        if self.config.keep_previous:
            served = {p.serving for p in self.parties.values() if p.role == "receiver" and p.alive and not p.left}
            keep |= {self.versions[s].slot for s in served if s in self.versions}
        if self.latest_committed is not None:
            keep.add(self.versions[self.latest_committed].slot)
        return keep

    async def op_begin_stage(self, party: int, version: int) -> dict[str, Any]:
        p = self._party(party)
        if p.role != "sender" or p.rank != 0:
            raise ProtocolError(f"{self._label(p)} may not stage versions; only sender rank 0 does")
        newest = max(max(self.versions, default=self.floor), self.floor)
        if newest >= 0 and version <= newest:
            what = "is reused" if version in self.versions else "goes backwards"
            raise VersionError(f"version {version} {what}: the newest version of this session is {newest}")
        for v in self.versions.values():
            if v.state == TRANSFERRING:
                raise VersionError(f"version {version} cannot start while version {v.version} is still transferring")
            if v.state in (STAGING, STAGED):
                self._abort(v, f"superseded by version {version} before its sync")
        pinned = self._pinned_slots()
        slot = next(i for i in range(len(pinned) + 1) if i not in pinned)
        if slot >= self.config.shm_max_segments:
            # out of room: give up the oldest pinned version a receiver still serves
            slot = next(i for i in range(self.config.shm_max_segments)
                        if self.latest_committed is None or i != self.versions[self.latest_committed].slot)
        self.versions[version] = Version(version, STAGING, slot, time.monotonic())
        self._poke(self.versions[version])
        return {"slot": slot}

    async def op_stage_info(self, party: int, version: int, info: dict) -> dict[str, Any]:
        """Early per-version info (where the bytes will be), so pipelined receivers can start."""
        self._party(party)
        v = self._version(version)
        v.info.update(info)
        self._poke(v)
        return {}

    async def op_staged(self, party: int, version: int, info: dict, stage_s: float) -> dict[str, Any]:
        self._party(party)
        v = self._version(version)
        if v.state == STAGING:
            v.state = STAGED
        v.info.update(info)
        v.phases["stage_s"] = stage_s
        self._poke(v)
        return {}

    async def op_abort(self, party: int, version: int, reason: str) -> dict[str, Any]:
        p = self._party(party)
        v = self.versions.get(version)
        if v is not None and v.state in IN_FLIGHT:
            self._abort(v, f"{self._label(p)}: {reason}")
        return {}

    def _abort(self, v: Version, reason: str) -> None:
        v.state, v.reason = ABORTED, reason
        v.finished = time.monotonic()
        for name in v.participants:
            if name not in v.committed:
                v.failed.setdefault(name, f"version aborted: {reason}")
        self._poke(v)

    async def op_begin_sync(self, party: int, version: int) -> dict[str, Any]:
        self._party(party)
        v = self.versions.get(version)
        if v is None:
            raise VersionError(f"sync({version}) was called but version {version} was never staged")
        if v.state == ABORTED:
            raise VersionError(f"version {version} was aborted while staging: {v.reason}")
        if v.state in (STAGING, STAGED):
            v.state = TRANSFERRING
            v.sync_started = time.monotonic()
            receivers = [p for p in self.parties.values()
                         if p.role == "receiver" and not p.left and not (p.reported_dead and not p.alive)]
            v.participants = sorted(p.name for p in receivers)
            for p in receivers:
                if not p.alive:
                    v.failed[p.name] = f"{self._label(p)} {p.why}"
                    p.reported_dead = True
                elif p.verdict not in (None, ""):
                    v.failed[p.name] = f"{self._label(p)} {p.why}"
            self._maybe_finish(v)
            self._poke(v)
        return {"participants": v.participants}

    async def op_wait_version(self, party: int, version: int | None, timeout: float, wait: bool = True,
                              prefetch: bool = False) -> dict[str, Any]:
        """Receivers: wait until ``version`` (or, for None, anything newer than what they
        serve) can be read; returns where its bytes are. ``prefetch``: only to read ahead,
        the receiver is not applying it yet."""
        p = self._party(party)
        deadline = time.monotonic() + timeout
        while True:
            p = self._party(party)
            target = self._target_for(p, version)
            if target is not None:
                v = self.versions[target]
                if not prefetch:
                    p.applying = target
                return {"version": target, "state": v.state, "slot": v.slot, "info": v.info}
            if version is not None and version in self.versions and self.versions[version].state == ABORTED:
                raise VersionError(f"version {version} was aborted: {self.versions[version].reason}")
            if not wait and (version is None or version in self.versions):
                return {"version": None}
            if time.monotonic() >= deadline:
                want = f"version {version}" if version is not None else "a version newer than the one served"
                sender = [s for s in self.parties.values() if s.role == "sender" and s.rank == 0]
                who = f"; sender: {self._label(sender[-1])}{' ' + sender[-1].why if sender[-1].why else ''}" if sender else "; no sender registered"
                raise DeadlineExceeded(f"receiver '{p.name}' waited {timeout:.1f}s for {want}{who}")
            waiter = self.versions[version].changed if version in self.versions else self.changed
            await self._wait(waiter, deadline)

    def _target_for(self, p: Party, version: int | None) -> int | None:
        if version is not None:
            v = self.versions.get(version)
            if v is None or v.state == ABORTED:
                return None
            if not self._readable(v):
                return None
            return version
        flight = [v.version for v in self.versions.values() if v.state in IN_FLIGHT]
        if flight and (p.serving is None or flight[-1] > p.serving):
            readable = self._readable(self.versions[flight[-1]])
            # a version on its way beats the committed one: wait for it rather than load twice
            return flight[-1] if readable else None
        if not self.transport_info.get("keeps_versions"):
            return None  # a streaming transport keeps nothing: late receivers join the next version
        cand = self.latest_committed
        if cand is None or (p.serving is not None and cand <= p.serving):
            return None
        return cand

    def _readable(self, v: Version) -> bool:
        if v.state != STAGING:
            return True
        return bool(self.transport_info.get("pipelined")) and bool(v.info.get("readable"))

    async def op_state(self, party: int, version: int) -> dict[str, Any]:
        self._party(party)
        v = self._version(version)
        return {"state": v.state, "reason": v.reason, "info": v.info}

    async def op_report(self, party: int, version: int, ok: bool, serving: int | None,
                        reason: str = "", metrics: dict | None = None) -> dict[str, Any]:
        p = self._party(party)
        p.serving, p.applying = serving, None
        v = self.versions.get(version)
        if v is not None:
            v.receivers[p.name] = dict(metrics or {})
            if ok:
                if p.name not in v.committed:
                    v.committed.append(p.name)
                v.failed.pop(p.name, None) if v.state in IN_FLIGHT else None
            elif p.name in v.participants or not v.participants:
                v.failed[p.name] = f"{self._label(p)}: {reason}"
            self._maybe_finish(v)
            self._poke(v)
        self._poke()
        return {}

    def _maybe_finish(self, v: Version) -> None:
        if v.state != TRANSFERRING:
            return
        if all(n in v.committed or n in v.failed for n in v.participants):
            v.finished = time.monotonic()
            if v.failed:
                v.state = ABORTED
                v.reason = "; ".join(f"{n}: {why}" for n, why in sorted(v.failed.items()))
            else:
                v.state = COMMITTED
                if self.latest_committed is None or v.version > self.latest_committed:
                    self.latest_committed = v.version
            self._poke(v)

    async def op_wait_outcome(self, party: int, version: int, timeout: float) -> dict[str, Any]:
        self._party(party)
        deadline = time.monotonic() + timeout
        # trainer ranks other than 0 may get here before rank 0 began the version
        while version not in self.versions:
            if time.monotonic() >= deadline or version <= self.floor:
                raise VersionError(f"version {version} was never staged (waited {timeout:.1f}s)")
            self._party(party)
            await self._wait(self.changed, deadline)
        v = self.versions[version]
        while v.state in IN_FLIGHT:
            self._party(party)
            if time.monotonic() >= deadline:
                if v.state != TRANSFERRING:
                    self._abort(v, f"version {version} did not reach the barrier within {timeout:.1f}s")
                    break
                for name in v.participants:
                    if name not in v.committed and name not in v.failed:
                        v.failed[name] = f"receiver '{name}' did not report version {version} within {timeout:.1f}s"
                self._maybe_finish(v)
                break
            await self._wait(v.changed, deadline)
        out = v.public(self.payload_bytes)
        if v.state == ABORTED:
            raise SyncFailed(version, v.failed or {"sender": v.reason}, v.committed)
        return out

    def _version(self, version: int) -> Version:
        v = self.versions.get(version)
        if v is None:
            raise VersionError(f"version {version} is unknown to this session")
        return v

    # -- broadcast transport: collective group membership (transports/broadcast.py) -------
    # A collective needs exactly the parties that take part in a version, each knowing its
    # group rank. Sender rank 0 fixes the group at the barrier (bcast_form); receivers learn
    # their rank from it (bcast_group). The group keeps its epoch, and so its communicator,
    # while membership stays the same; a new member set, or a failed version (which leaves
    # the old communicator unusable), bumps the epoch and the parties re-form under a fresh
    # store prefix. Parties are named in these ops, since the transport has no party id.

    def _bcast(self) -> dict[str, Any]:
        state = getattr(self, "_bcast_state", None)
        if state is None:
            state = self._bcast_state = {"epoch": 0, "key": None, "last": None, "groups": {}}
        return state

    def _named(self, role: str, name: str) -> Party | None:
        found = [p for p in self.parties.values() if p.role == role and p.name == name and not p.left]
        return found[-1] if found else None

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
                lost.append(f"{self._label(p)} {p.why}")
            elif name in v.failed and not v.failed[name].startswith("version aborted"):
                lost.append(v.failed[name])
        return lost

    async def op_bcast_form(self, name: str, version: int) -> dict[str, Any]:
        """Sender rank 0, right after begin_sync: fix the group of ``version``."""
        v = self._version(version)
        if v.state == ABORTED:
            raise VersionError(f"version {version} was aborted: {v.reason}")
        sender = self._named("sender", name)
        if sender is None:
            raise ProtocolError(f"sender '{name}' is not in the session")
        members = sorted((p for p in self.parties.values()
                          if p.role == "receiver" and not p.left and p.alive and p.name in v.participants
                          and p.name not in v.failed), key=lambda p: (p.rank, p.name))
        key = [[sender.pid]] + [[p.name, p.pid] for p in members]
        state = self._bcast()
        last = self.versions.get(state["last"]) if state["last"] is not None else None
        if key != state["key"] or (last is not None and last.state == ABORTED):
            state["epoch"] += 1
            state["key"] = key
        state["last"] = version
        group = {"epoch": state["epoch"], "nonce": self.session, "sender": name, "members": [p.name for p in members],
                 "pids": {p.name: p.pid for p in members} | {name: sender.pid}, "size": len(members) + 1}
        state["groups"][version] = group
        v.info["group"] = {"epoch": group["epoch"], "members": group["members"]}  # shown in metrics
        for old in [k for k in state["groups"] if k < version - 8]:
            del state["groups"][old]
        self._poke(v)
        return group

    async def op_bcast_group(self, name: str, version: int, timeout: float) -> dict[str, Any]:
        """Receivers: wait for the group of ``version``; returns it with this receiver's rank."""
        deadline = time.monotonic() + timeout
        state = self._bcast()
        while version not in state["groups"]:
            v = self._version(version)
            if v.state == ABORTED:
                raise VersionError(f"version {version} was aborted: {v.reason}")
            if v.state == COMMITTED:
                raise VersionError(f"version {version} committed without receiver '{name}' in its group")
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"receiver '{name}' waited {timeout:.1f}s for the sender to reach the "
                                       f"barrier of version {version}")
            await self._wait(v.changed, deadline)
        group = state["groups"][version]
        if name not in group["members"]:
            p = self._named("receiver", name)
            why = f" ({p.why})" if p is not None and p.why else ""
            raise VersionError(f"receiver '{name}' is not in the broadcast group of version {version}: it was not a "
                               f"live participant when the sender reached the barrier{why}; it joins the next version")
        return {**group, "rank": group["members"].index(name) + 1}

    async def op_bcast_check(self, name: str, version: int) -> dict[str, Any]:
        """Polled by a party whose collective is slow: is the version still on, and who is lost?"""
        v = self._version(version)
        group = self._bcast()["groups"].get(version)
        lost = self._bcast_lost(v, group, name) if group is not None else []
        return {"aborted": v.reason if v.state == ABORTED else None, "lost": lost}

    async def op_bcast_failed(self, name: str, version: int, error: str, timeout: float) -> dict[str, Any]:
        """A member's collective failed: name the party at fault and abort ``version`` for
        everyone, so no member keeps waiting on a broken group. A killed peer shows up as a
        closed connection at once but as a silent party only after heartbeat_timeout_s, so
        this waits up to ``timeout`` for the monitor to name it."""
        v = self._version(version)
        group = self._bcast()["groups"].get(version)
        deadline = time.monotonic() + timeout
        lost: list[str] = []
        while group is not None and v.state != ABORTED:
            lost = self._bcast_lost(v, group, name)
            if lost or time.monotonic() >= deadline:
                break
            await self._wait(self.changed, deadline)
        if v.state != ABORTED:
            epoch = f" (epoch {group['epoch']})" if group else ""
            why = "lost " + "; ".join(lost) if lost else f"failed on '{name}': {error}"
            if v.state in IN_FLIGHT:
                self._abort(v, f"broadcast group{epoch} {why}")
            else:
                return {"reason": f"broadcast group{epoch} {why}"}
        return {"reason": v.reason}

    # -- staleness (one-step-off) --------------------------------------------------------

    async def op_check_batch(self, party: int, batch_version: int, step: int,
                             max_staleness: int | None = None) -> dict[str, Any]:
        from .staleness import check_staleness

        limit = self.config.max_staleness if max_staleness is None else max_staleness
        self.batches.append({"version": batch_version, "step": step})
        del self.batches[:-1000]
        check_staleness(batch_version, step, limit)
        return {"lag": step - batch_version}

    # -- reading -------------------------------------------------------------------------

    async def op_status(self) -> dict[str, Any]:
        now = time.monotonic()
        recent = sorted(self.versions)[-20:]
        return {
            "session": self.session,
            "transport": self.transport, "transport_reason": self.transport_reason,
            "manifest_tensors": len(self.manifest or ()), "payload_bytes": self.payload_bytes,
            "latest_committed": self.latest_committed,
            "parties": [p.public(now) for p in sorted(self.parties.values(), key=lambda p: (p.role, p.rank, p.pid))
                        if not p.left],
            "versions": [self.versions[v].public(self.payload_bytes) for v in recent],
            "resources": dict(self.resources),
            "config": self.config.to_dict(),
        }

    async def op_metrics(self, version: int) -> dict[str, Any]:
        return self._version(version).public(self.payload_bytes)


def _raise_remote(reply: dict[str, Any]) -> None:
    kind, error = reply.get("kind", "WeightSyncError"), reply.get("error", "")
    if kind == "SyncFailed":
        raise SyncFailed(reply["version"], reply["failed"], reply.get("committed"))
    raise _ERRORS.get(kind, WeightSyncError)(error)


class Coordinator:
    """Client handle of the coordinator actor; picklable, so it can be handed to workers.

    ``Coordinator.create()`` starts the actor in the driver; workers receive the handle (or
    call ``Coordinator.connect(name, token)``). Every call presents the session token.
    """

    def __init__(self, actor: Any, name: str, namespace: str, token: str, config: SyncConfig):
        self.actor, self.name, self.namespace, self.token, self.config = actor, name, namespace, token, config

    @classmethod
    def create(cls, config: SyncConfig | dict | None = None, *, name: str | None = None,
               expected_receivers: int | None = None, detached: bool = False,
               token: str | None = None, actor_options: dict | None = None) -> Coordinator:
        cfg = config if isinstance(config, SyncConfig) else SyncConfig.load(config)
        name = name or cfg.coordinator_name
        token = token or secrets.token_hex(16)
        # Ray restarts a crashed coordinator; parties then re-register (Party._call) and the
        # next version goes through. Calls in flight during the restart are retried.
        options = {"name": name, "max_concurrency": 1000, "num_cpus": 0, "max_restarts": -1, "max_task_retries": -1}
        if cfg.namespace:
            options["namespace"] = cfg.namespace
        if detached:
            options["lifetime"] = "detached"
        options.update(actor_options or {})
        actor_cls = ray.remote(CoordinatorActor)
        try:
            actor = actor_cls.options(**options).remote(cfg.to_dict(), token, expected_receivers)
        except ValueError as exc:  # Ray: name already taken
            raise WeightSyncError(f"a coordinator named {name!r} already exists in this Ray namespace: {exc}") from None
        client = cls(actor, name, cfg.namespace, token, cfg)
        client.call("status", rpc_timeout=cfg.connect_timeout_s)
        return client

    @classmethod
    def connect(cls, name: str, token: str, config: SyncConfig | dict | None = None) -> Coordinator:
        cfg = config if isinstance(config, SyncConfig) else SyncConfig.load(config)
        try:
            actor = ray.get_actor(name, namespace=cfg.namespace or None)
        except ValueError:
            raise WeightSyncError(f"no coordinator named {name!r} is running") from None
        return cls(actor, name, cfg.namespace, token, cfg)

    def call(self, op: str, *, rpc_timeout: float | None = None, **args: Any) -> Any:
        payload = protocol.encode({"op": op, "token": self.token, "args": args})
        ref = self.actor.rpc.remote(payload)
        # the rpc itself may wait up to args["timeout"]; allow it that plus slack
        limit = (rpc_timeout if rpc_timeout is not None else self.config.connect_timeout_s) + float(args.get("timeout", 0) or 0) + 5.0
        try:
            raw = ray.get(ref, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise DeadlineExceeded(f"coordinator '{self.name}' did not answer {op!r} within {limit:.1f}s") from None
        except ray.exceptions.RayActorError as exc:
            raise WeightSyncError(f"coordinator '{self.name}' is unreachable (actor died?): {exc}") from None
        reply = protocol.decode(raw)
        if not reply.get("ok"):
            _raise_remote(reply)
        return reply.get("result")

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def format_status(self) -> str:
        from .report import format_status

        return format_status(self.status())

    def check_batch(self, batch_version: int, step: int, max_staleness: int | None = None) -> int:
        """Raise StalenessError when a batch made with ``batch_version`` is too old for ``step``."""
        return self.call("check_batch", party=0, batch_version=batch_version, step=step,
                         max_staleness=max_staleness)["lag"]

    def shutdown(self) -> None:
        try:
            ray.kill(self.actor)
        except Exception:  # already gone
            pass
