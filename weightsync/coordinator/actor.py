"""Internal. The coordinator actor: one named Ray actor per job. It never touches tensor bytes.

Parties (senders, receivers) call it through one ``rpc(bytes) -> bytes`` method, through Ray or
over its control channel (:class:`Server`), carrying a request record of
:mod:`weightsync.records` as msgpack (:mod:`weightsync.coordinator.client` is the client side);
every call presents the session token, and parties send heartbeats. Each request type has
exactly one handler here, marked ``@handles(Request)``, which answers with the request's reply
record. A monitor task turns a silent party into an error that names it. What a version may do
next is decided by :class:`~weightsync.coordinator.state.VersionTable`; this module adds the
session registry, liveness, waits with deadlines and wake-ups, and the broadcast transport's
group membership (who takes part in each broadcast version, and who broke a group).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import secrets
import socket
import time
from collections.abc import Awaitable, Callable

import ray

from .. import records
from ..config import SyncConfig
from ..errors import DeadlineExceeded, ManifestError, ProtocolError, SyncFailed, VersionError, WeightSyncError
from ..records import FRAME_HEADER, MAX_MESSAGE_BYTES, handles
from .staleness import check_staleness
from .state import (
    BroadcastGroups,
    Candidate,
    GroupMember,
    Parties,
    PartyRecord,
    Signals,
    State,
    Version,
    VersionTable,
    choose_slot,
    group_rank,
    pinned_slots,
)


class Server:
    """The control channel: the coordinator's calls over a plain TCP connection, beside Ray.

    One Ray actor call costs 1-2.5 ms of round trip on a loaded 2-core machine, and a version
    makes several on its critical path (figures: docs/design.md, Parties). This serves the same
    payloads on a port of the actor's own event loop: a frame is a 4-byte big-endian length and
    the msgpack payload exactly as ``CoordinatorActor.rpc`` takes it, and the reply frame is
    exactly what ``rpc`` returns, so the token check and the decoding stay in one place and
    nothing new is unpickled. Each connection serves its frames in order; a client holds one
    connection per thread, so a long poll blocks only its own (``client.Link``).

    ``served``: payloads the handler took, whichever way they came (the actor counts them);
    ``frames``: those that came over the channel."""

    def __init__(self, handler: Callable[[bytes], Awaitable[bytes]]):
        self.handler = handler
        self.served = self.frames = 0
        self._opening: asyncio.Task | None = None
        self._server: asyncio.AbstractServer | None = None

    def via(self) -> dict[str, int]:
        """Payloads served by the way they came (``Status.via``)."""
        return {"ray": self.served - self.frames, "socket": self.frames}

    async def open(self, mode: str) -> records.ChannelAddress:
        """Where the channel listens, from the first call on; ``mode``: the config's
        ``control_channel``.

        Raises:
            ProtocolError: ``mode`` is not "socket": clients keep to Ray.
            WeightSyncError: The port could not be opened (the next ask tries again).
        """
        if mode != "socket":
            raise ProtocolError(f"this coordinator serves no control channel (control_channel: {mode})")
        if self._opening is None:
            # a task, not a plain await: calls asking at once all wait for the one port it opens
            self._opening = asyncio.get_running_loop().create_task(self._start())
        try:
            return await asyncio.shield(self._opening)
        except OSError as exc:
            self._opening = None
            raise WeightSyncError(f"cannot open the control channel: {exc}") from None

    async def _start(self) -> records.ChannelAddress:
        host = ray.util.get_node_ip_address()  # the address other nodes reach this one by
        self._server = await asyncio.start_server(self._serve, host, 0)
        return records.ChannelAddress(host=host, port=self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(FRAME_HEADER), "big")
                if size > MAX_MESSAGE_BYTES:
                    return  # no way to find the next frame; the client's call goes through Ray instead
                payload = await reader.readexactly(size)
                self.frames += 1
                reply = await self.handler(payload)
                writer.write(len(reply).to_bytes(FRAME_HEADER, "big") + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed (its thread ended, or it gave up waiting)
        finally:
            writer.close()


class CoordinatorActor:
    """The actor body. Use :class:`weightsync.Coordinator` to create or reach it."""

    def __init__(self, config: records.WireMap, token: str):
        self.config = SyncConfig.from_mapping(config)
        self.token = token
        self.session = secrets.token_hex(8)
        # party ids carry the incarnation: after a restart, a party still holding an id from
        # before gets SessionLost and registers again, instead of passing for whoever took
        # that small number first in the new session
        self.parties = Parties(first_pid=(int(self.session, 16) >> 32 << 20) + 1)
        self.table = VersionTable()
        self.bcast = BroadcastGroups()
        self.manifest: list[records.Wire] | None = None
        self.digest: str | None = None
        self.payload_bytes = 0
        self.transport: str | None = None
        self.transport_reason = ""
        self.transport_info: records.WireMap = {}  # the transport's own, for receivers only
        self.pipelined = self.keeps_versions = False  # the transport's traits (SenderTransport)
        self.resources: dict[str, int] = {}
        self.signals = Signals()
        self._monitor: asyncio.Task | None = None
        # control-plane calls served, by op: status() shows them, so the calls one version
        # costs can be counted (docs/benchmarks.md)
        self.calls: dict[str, int] = {}
        self.channel = Server(self.rpc)

    # -- the one entry point -------------------------------------------------------------

    async def rpc(self, payload: bytes) -> bytes:
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())
        self.channel.served += 1
        try:
            msg = records.decode(payload)
            if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
                raise ProtocolError("control message must be a map with an 'op'")
            if not hmac.compare_digest(str(msg.get("token", "")), self.token):
                raise ProtocolError(f"op {msg['op']!r} refused: wrong session token for coordinator")
            if (kind := records.REQUESTS.get(msg["op"])) is None:
                raise ProtocolError(f"unknown op {msg['op']!r}")
            self.calls[kind.op] = self.calls.get(kind.op, 0) + 1
            result = await records.HANDLERS[kind](self, kind.from_wire(msg.get("args", {})))
            return records.encode({"ok": True, "type": type(result).__name__, "result": result.to_wire()})
        except WeightSyncError as exc:
            if isinstance(exc, SyncFailed):
                failure = records.Failure(kind="SyncFailed", error=str(exc), failed=exc.failed,
                                          committed=exc.committed, version=exc.version)
            else:
                failure = records.Failure(kind=type(exc).__name__, error=str(exc))
            return records.encode({"ok": False, **failure.to_wire()})
        except TypeError as exc:
            failure = records.Failure(kind="ProtocolError", error=f"bad arguments: {exc}")
            return records.encode({"ok": False, **failure.to_wire()})

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

    # -- registration and session --------------------------------------------------------

    @handles(records.Register)
    async def register(self, req: records.Register) -> records.Registered:
        """Join the session. A party re-registering after a coordinator restart brings what
        the coordinator lost: the newest version it staged (senders) or the version it
        serves and where its bytes are (receivers), so versions keep going up and rollback
        data stays pinned."""
        record, replaced = self.parties.add(req.role, req.name, req.rank, req.host, req.os_pid, req.node_id,
                                            req.device, time.monotonic())
        for other in replaced:
            self._party_lost(other)
        if req.last_version is not None:
            self.table.raise_floor(req.last_version)
        if req.serving is not None:
            record.serving = req.serving
            self.table.raise_floor(record.serving)
            if req.served is not None:
                self.table.restore_committed(record.serving, int(req.served.slot or 0), dict(req.served.info),
                                             time.monotonic())
        self._poke()
        return records.Registered(party=record.pid, session=self.session, config=self.config.to_dict())

    @handles(records.Heartbeat)
    async def heartbeat(self, req: records.Heartbeat) -> records.Done:
        self._party(req.party)
        return records.Done()

    @handles(records.Leave)
    async def leave(self, req: records.Leave) -> records.Done:
        p = self.parties.leave(req.party)
        if p is not None:
            self._party_lost(p)
        return records.Done()

    @handles(records.Publish)
    async def publish(self, req: records.Publish) -> records.Done:
        self._party(req.party)
        pub = req.publication
        if self.digest is not None and self.digest != pub.digest:
            raise ManifestError(
                "the sender offers a different manifest than the one this session agreed; "
                "a new layout needs a new coordinator (a new session)"
            )
        self.manifest, self.digest, self.payload_bytes = pub.manifest, pub.digest, pub.payload_bytes
        self.transport, self.transport_reason, self.transport_info = pub.transport, pub.reason, dict(pub.info)
        self.pipelined, self.keeps_versions = pub.pipelined, pub.keeps_versions
        self._poke()
        return records.Done()

    @handles(records.Session)
    async def session_of(self, req: records.Session) -> records.SessionInfo:
        deadline = time.monotonic() + req.timeout
        while self.manifest is None:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"no sender published a manifest within {req.timeout:.1f}s")
            self._party(req.party, seen=False)
            await self.signals.wait(self.signals.any, deadline)
        return records.SessionInfo(manifest=self.manifest, digest=self.digest or "", transport=self.transport or "",
                                   info=self.transport_info, session=self.session)

    @handles(records.Receivers)
    async def receivers(self, req: records.Receivers) -> records.Placements:
        deadline = time.monotonic() + req.timeout
        self._party(req.party)
        while True:
            self._party(req.party, seen=False)
            live = self.parties.receivers()
            if len(live) >= req.count:
                return records.Placements(receivers=[
                    records.Placement(name=p.name, rank=p.rank, host=p.host, node_id=p.node_id,
                                      device=p.device, serving=p.serving)
                    for p in live])
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"only {len(live)} of {req.count} receivers registered within {req.timeout:.1f}s: "
                    f"{sorted(p.name for p in live)}"
                )
            await self.signals.wait(self.signals.any, deadline)

    @handles(records.Verdict)
    async def verdict(self, req: records.Verdict) -> records.Done:
        p = self._party(req.party)
        p.verdict = "" if req.accepted else (req.why or "rejected")
        if not req.accepted:
            p.why = f"rejected the manifest: {req.why}"
            # a barrier that began before the check came back counted this receiver in: fail
            # those versions now, naming it, instead of waiting for a report that never comes
            for v in self.table.receiver_lost(p.name, f"{p.label} {p.why}", time.monotonic()):
                self._poke(v)
        self._poke()
        return records.Done()

    @handles(records.Resource)
    async def resource(self, req: records.Resource) -> records.Done:
        self._party(req.party)
        self.resources[req.kind] = self.resources.get(req.kind, 0) + req.delta
        return records.Done()

    # -- versions: thin wrappers over the table, adding waits and wake-ups -----------------

    def _slot_for_new_version(self) -> int:
        served = {p.serving for p in self.parties.receivers()}
        pinned = pinned_slots(self.table, served, self.config.keep_previous)
        latest = self.table.latest_committed
        return choose_slot(pinned, self.config.shm_max_segments,
                           self.table.versions[latest].slot if latest is not None else None)

    @handles(records.BeginStage)
    async def begin_stage(self, req: records.BeginStage) -> records.Slot:
        p = self._party(req.party)
        if p.role != "sender" or p.rank != 0:
            raise ProtocolError(f"{p.label} may not stage versions; only sender rank 0 does")
        v, superseded = self.table.begin_stage(req.version, self._slot_for_new_version, time.monotonic())
        self._poke(v, *superseded)
        return records.Slot(slot=v.slot)

    @handles(records.StageInfo)
    async def stage_info(self, req: records.StageInfo) -> records.Done:
        """More per-version info (where the bytes are, the digest once known); ``readable``:
        a pipelined sender announced the version, receivers may start reading it."""
        self._party(req.party)
        v = self.table[req.version]
        v.info.update(req.info)
        v.readable = v.readable or req.readable
        self._poke(v)
        return records.Done()

    @handles(records.Staged)
    async def staged(self, req: records.Staged) -> records.Done:
        self._party(req.party)
        self._poke(self.table.staged(req.version, req.info, req.stage_s))
        return records.Done()

    @handles(records.Abort)
    async def abort(self, req: records.Abort) -> records.Done:
        p = self._party(req.party)
        if self.table.abort(req.version, f"{p.label}: {req.reason}", time.monotonic()):
            self._poke(self.table[req.version])
        return records.Done()

    @handles(records.BeginSync)
    async def begin_sync(self, req: records.BeginSync) -> records.Participants:
        self._party(req.party)
        version = req.version
        eligible = self.parties.at_barrier()
        ahead = self.bcast.get(version) if self.table.get(version) is not None else None
        if ahead is not None and self.table[version].state in (State.STAGING, State.STAGED):
            # its bytes moved before the barrier, to this group: a receiver that joined since
            # takes the next version (as one that joins after a barrier does)
            eligible = [p for p in eligible if p.name in ahead.members]
        offered = [Candidate(p.name, f"{p.label} {p.why}" if not p.alive or p.rejected else None) for p in eligible]
        before = self.table.get(version)
        opening = before is not None and before.state in (State.STAGING, State.STAGED)
        v = self.table.begin_sync(version, offered, time.monotonic())
        if opening:
            for p in eligible:
                p.reported_dead = p.reported_dead or not p.alive  # named in this version, not again
        self._poke(v)
        return records.Participants(participants=list(v.participants), failed=sorted(v.failed))

    @handles(records.WaitVersion)
    async def wait_version(self, req: records.WaitVersion) -> records.Target:
        """Receivers: wait until ``version`` (or, for None, anything newer than what they
        serve) can be read; returns where its bytes are (records.WaitVersion)."""
        version, after, timeout = req.version, req.after, req.timeout
        p = self._party(req.party)
        if req.ahead and not p.ahead:
            p.ahead = True
            self._poke()
        deadline = time.monotonic() + timeout
        while True:
            p = self._party(req.party, seen=False)
            floor = p.serving if after is None else after if p.serving is None else max(after, p.serving)
            target = self.table.target_for(floor, version, pipelined=self.pipelined,
                                           keeps_versions=self.keeps_versions)
            if target is not None:
                v = self.table[target]
                if not req.prefetch:
                    p.applying = target
                return records.Target(version=target, state=v.state.value, slot=v.slot, info=v.info)
            asked = self.table.get(version) if version is not None else None
            if asked is not None and asked.state == State.ABORTED:
                raise VersionError(f"version {version} was aborted: {asked.reason}")
            if not req.wait and (version is None or asked is not None):
                return records.Target(version=None)
            if time.monotonic() >= deadline:
                want = f"version {version}" if version is not None else "a version newer than the one served"
                s0 = self.parties.sender0()
                who = f"; sender: {s0.label}{' ' + s0.why if s0.why else ''}" if s0 else "; no sender registered"
                raise DeadlineExceeded(f"receiver '{p.name}' waited {timeout:.1f}s for {want}{who}")
            await self.signals.wait(self.signals.version(version) if asked is not None else self.signals.any, deadline)

    @handles(records.GetState)
    async def state(self, req: records.GetState) -> records.VersionState:
        self._party(req.party)
        v = self.table[req.version]
        return records.VersionState(state=v.state.value, reason=v.reason, info=v.info)

    @handles(records.Report)
    async def report(self, req: records.Report) -> records.Done:
        p = self._party(req.party)
        p.serving, p.applying = req.serving, None
        v = self.table.report(req.version, p.name, req.ok, f"{p.label}: {req.reason}", req.metrics, time.monotonic())
        if v is not None:
            self._poke(v)
        self._poke()
        return records.Done()

    @handles(records.WaitOutcome)
    async def wait_outcome(self, req: records.WaitOutcome) -> records.Metrics:
        """Wait until ``version`` committed or failed; ``info``: a sender's late stage_info
        (the digest of a transport that packs at the barrier), folded into this call."""
        version, timeout, party = req.version, req.timeout, req.party
        self._party(party)
        deadline = time.monotonic() + timeout
        # trainer ranks other than 0 may get here before rank 0 began the version
        while version not in self.table:
            if time.monotonic() >= deadline or version <= self.table.floor:
                raise VersionError(f"version {version} was never staged (waited {timeout:.1f}s)")
            self._party(party, seen=False)
            await self.signals.wait(self.signals.any, deadline)
        v = self.table[version]
        if req.info:
            v.info.update(req.info)
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

    # -- broadcast membership --------------------------------------------------------------
    # A collective needs exactly the parties that take part in a version, each knowing its group
    # rank: sender rank 0 fixes the group at the barrier (or ahead of it), receivers wait for it
    # and learn their rank; a member whose collective breaks asks who broke it. The group's
    # epoch (state.BroadcastGroups) decides when the communicator must be built again.

    @handles(records.BcastForm)
    async def bcast_form(self, req: records.BcastForm) -> records.Formed:
        """Sender rank 0, right after begin_sync: fix the group of ``version``. ``ahead``: in
        stage() instead, with every live receiver, if each one's ahead thread is ready to take
        the version into its shadow; else no group and the version goes at the barrier."""
        sender = self._party(req.party)
        v = self.table[req.version]
        if v.state == State.ABORTED:
            raise VersionError(f"version {req.version} was aborted: {v.reason}")
        if req.ahead:
            live = [p for p in self.parties.receivers() if not p.rejected]
            if not live or not all(p.ahead and p.verdict == "" for p in live):
                return records.Formed(group=None)
            members = [GroupMember(p.name, p.pid, p.rank) for p in live]
        else:
            members = [GroupMember(p.name, p.pid, p.rank) for p in self.parties.receivers()
                       if p.name in v.participants and p.name not in v.failed]
        last = self.table.get(self.bcast.last) if self.bcast.last is not None else None
        group = self.bcast.form(req.version, GroupMember(sender.name, sender.pid), members,
                                last_failed=last is not None and last.state == State.ABORTED, nonce=self.session)
        v.info["group"] = {"epoch": group.epoch, "members": group.members}  # shown in metrics
        self._poke(v)
        return records.Formed(group=group)

    @handles(records.BcastGroup)
    async def bcast_group(self, req: records.BcastGroup) -> records.BroadcastGroup:
        """Receivers: wait for the group of ``version``; returns it with this receiver's rank."""
        version = req.version
        name = self._party(req.party).name
        deadline = time.monotonic() + req.timeout
        while self.bcast.get(version) is None:
            v = self.table[version]
            if v.state == State.ABORTED:
                raise VersionError(f"version {version} was aborted: {v.reason}")
            if v.state == State.COMMITTED:
                raise VersionError(f"version {version} committed without receiver '{name}' in its group")
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"receiver '{name}' waited {req.timeout:.1f}s for the sender to reach the "
                                       f"barrier of version {version}")
            self._party(req.party, seen=False)
            await self.signals.wait(self.signals.version(version), deadline)
        group = self.bcast.get(version)
        rank = group_rank(group, name)
        if rank is None:
            p = self.parties.named("receiver", name)
            why = f" ({p.why})" if p is not None and p.why else ""
            raise VersionError(f"receiver '{name}' is not in the broadcast group of version {version}: it was not a "
                               f"live participant when the sender reached the barrier{why}; it joins the next version")
        return dataclasses.replace(group, rank=rank)

    @handles(records.BcastCheck)
    async def bcast_check(self, req: records.BcastCheck) -> records.GroupCheck:
        """Polled by a party whose collective is slow: is the version still on, and who is lost?"""
        name = self._party(req.party).name
        v = self.table[req.version]
        group = self.bcast.get(req.version)
        lost = self.parties.lost_members(v, group, name) if group is not None else []
        return records.GroupCheck(aborted=v.reason if v.state == State.ABORTED else None, lost=lost)

    @handles(records.BcastFailed)
    async def bcast_failed(self, req: records.BcastFailed) -> records.Reason:
        """A member's collective failed: name the party at fault and abort ``version`` for
        everyone, so no member keeps waiting on a broken group. A killed peer shows up as a
        closed connection at once but as a silent party only after heartbeat_timeout_s, so
        this waits up to ``timeout`` for the monitor to name it."""
        name = self._party(req.party).name
        v = self.table[req.version]
        group = self.bcast.get(req.version)
        deadline = time.monotonic() + req.timeout
        lost: list[str] = []
        while group is not None and v.state != State.ABORTED:
            lost = self.parties.lost_members(v, group, name)
            if lost or time.monotonic() >= deadline:
                break
            await self.signals.wait(self.signals.any, deadline)
        if v.state != State.ABORTED:
            epoch = f" (epoch {group.epoch})" if group else ""
            why = "lost " + "; ".join(lost) if lost else f"failed on '{name}': {req.error}"
            if not self.table.abort(req.version, f"broadcast group{epoch} {why}", time.monotonic()):
                return records.Reason(reason=f"broadcast group{epoch} {why}")
            self._poke(v)
        return records.Reason(reason=v.reason)

    # -- staleness (one-step-off) --------------------------------------------------------

    @handles(records.CheckBatch)
    async def check_batch(self, req: records.CheckBatch) -> records.Lag:
        limit = self.config.max_staleness if req.max_staleness is None else req.max_staleness
        check_staleness(req.batch_version, req.step, limit)
        return records.Lag(lag=req.step - req.batch_version)

    @handles(records.Channel)
    async def open_channel(self, req: records.Channel) -> records.ChannelAddress:
        return await self.channel.open(self.config.control_channel)

    # -- reading -------------------------------------------------------------------------

    @handles(records.GetStatus)
    async def status(self, req: records.GetStatus) -> records.Status:
        now = time.monotonic()
        return records.Status(
            session=self.session,
            transport=self.transport, transport_reason=self.transport_reason,
            pipelined=self.pipelined,
            group={k: self.transport_info[k] for k in ("backend", "communicator", "communicator_reason")
                   if k in self.transport_info},
            manifest_tensors=len(self.manifest or ()), payload_bytes=self.payload_bytes,
            latest_committed=self.table.latest_committed,
            parties=self.parties.public(now),
            versions=[v.public(self.payload_bytes) for v in self.table.recent(20)],
            resources=dict(self.resources),
            calls=dict(self.calls),
            via=self.channel.via(),
            config=self.config.to_dict(),
        )

    @handles(records.GetMetrics)
    async def metrics(self, req: records.GetMetrics) -> records.Metrics:
        return self.table[req.version].public(self.payload_bytes)
