"""Internal. Relay transport: one copy of each version per receiving host, relayed host to host.

Across hosts the version travels a chain: the sender sends it to one receiver of the first
receiving host (its *member* there), that member passes each bucket on to the member of the
next host as soon as the bucket arrived, and so on. So the sender's link carries one payload
however many hosts receive, every link carries it once in each direction at most, and the
hosts' transfers overlap bucket by bucket: a version takes about one payload's link time plus
a bucket per host. Within a host, the member writes the version into a segment of its host's
shared memory (transports/shm/transport.py: Slots), and every other receiver there (a
*follower*) reads it from that segment as a shm receiver does, each bucket verified once per
host. Receivers on the sender's own host follow the sender, which writes such a segment too.

Each hop is a process group of two (the upstream party at rank 0) built on the sender's
TCPStore, as the broadcast transport builds its group (transports/broadcast/): the same
communicators, buffers, digest trailer and failure handling. Why a chain of pairs rather than
one group: gloo's broadcast sends the root's payload to several members itself (measured between
isolated hosts: 2 payloads out of the sender for 2 receiving hosts, 3 for 4 receivers on 2 hosts);
a chain keeps it at one. Who is a
member and who follows whom is fixed per version by the coordinator at the barrier
(records.BroadcastGroup: ``members`` in chain order, ``followers``), from where the receivers
run.

A sharded session (every trainer rank holds its rows of each tensor, docs/sharded.md): each
trainer rank sends its own rows of each bucket, packed one after another with their digest, over
a pair of its own to each of the first ``heads`` members (as many as there are trainer hosts, at
most one per receiving host), each of which puts every rank's rows into their places (checking
each rank's digest), digests the whole bucket and relays it on to the member ``heads`` places
after it, as above. So no trainer rank gathers anything, each trainer host's link carries its own
ranks' rows once per head (one payload in all when heads == trainer hosts), and every receiving
host takes in one payload, none sending on more than one. Why heads and not one chain: a host
that relays while it takes in the rows of several ranks at its link's rate sends on slower than
its rate (measured between isolated hosts: 0.21 s for a 16 MiB bucket a 1 Gbit/s link carries in
0.134 s). Receivers on a trainer host are members like any other (no trainer rank holds a whole
bucket to write for them). The version's digest is the receivers' (of the whole buckets the heads
checked and digested); the trainer ranks know only their rows'.

Guarantees as everywhere: every bucket carries its digest (checked by each member on its way in
and once per host in the segment), all-or-nothing (a member whose hop breaks names the party at
fault and the version aborts for everyone), rollback (a receiver that fails part-way loads the
previous version again from its host's segment, which keeps it). Late joiners wait for the next
version, as with broadcast. Host memory only (gloo): on an accelerator the collective's own ring
(broadcast over NCCL / HCCL) already relays.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ... import digest
from ...errors import ConfigError, DeadlineExceeded, VersionError, WeightSyncError
from ...manifest import Packer, PackViews, RowWriter
from ...records import BroadcastGroup, SessionRecord, VersionRecord
from .. import Aborted, Bucket, Deadline, ReceiverTransport, RowsSent, SenderTransport, TransportContext
from ..broadcast.communicators import choose_communicator
from ..broadcast.ends import BUFFERS, WholeIn, put_checksum, tell_failed
from ..broadcast.groups import Group, retire, settle
from ..broadcast.rows import RowsIn
from ..broadcast.store import connect_store, host_store, store_host
from ..shm.transport import ShmReceiver, ShmSession, ShmVersion, Slots

TRAILER = 8  # bytes of the digest that follows a bucket's payload on the wire
# a member's buckets on their way down the chain, copied out of its inbound buffers: those take
# the next buckets whatever the next host's link does (passing on from the inbound buffer, a
# member took in bucket b + 2 only once b had left: 1.60x the link time against 1.30x, sharded
# with 3 receiving hosts, results/relay-passing-ab-2026-11-29)
PASSING = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelaySession(SessionRecord):
    transport: ClassVar[str] = "relay"
    communicator: str  # how each hop's group is built (transports/broadcast/communicators.py)
    host: str  # of the sender's TCPStore
    port: int
    store_id: str  # tells this sender's store from a restarted sender's

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("port", 0 < self.port < 65536, "a TCP port")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelayVersion(VersionRecord):
    """The store's address rides along (receivers of a restarted sender follow its new store),
    and the slot every host's segment keeps the version in."""

    transport: ClassVar[str] = "relay"
    session: RelaySession
    slot: int


class _End:
    """What both ends share: the store, the hop groups of the current epoch, two wire buffers (and
    a member's two copies of what it passes on)."""

    def _setup(self, ctx: TransportContext, who: str, communicator: str) -> None:
        self.ctx, self.who = ctx, who
        try:
            self.communicator, self.communicator_reason = choose_communicator(communicator, "gloo")
        except ConfigError as exc:
            raise ConfigError(f"{who}: {exc}") from None
        self.device = torch.device("cpu")
        self.trailer = TRAILER if digest.kind_of(ctx.config, "cpu") else 0
        self.store: dist.TCPStore | None = None
        self.hops: dict[str, Group] = {}  # by pair: hop<i> of the chain, rows<r> of rank r
        self.epoch: tuple[str, int] | None = None
        self.buffers: list[torch.Tensor] | None = None
        self.passing: list[torch.Tensor] | None = None  # a member's copies of the buckets it passes on
        self.generation = 0  # bumped whenever the buffers go (Bucket.generation)
        self.pending: list[Any] = []  # ops posted and not yet settled
        self.views = PackViews()  # the sender's: where each bucket's tensors go in each buffer
        self.slots = Slots(ctx)  # this host's copy of each version, for its followers

    def _wire(self, b: int, nbytes: int) -> torch.Tensor:
        if self.buffers is None:
            size = self.ctx.plan.bucket_bytes + self.trailer
            self.buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(BUFFERS)]
            self.ctx.account("relay_buffers", +BUFFERS)
        return self.buffers[b % BUFFERS][: nbytes + self.trailer]

    def _passing(self, b: int, nbytes: int) -> torch.Tensor:
        if self.passing is None:
            size = self.ctx.plan.bucket_bytes + self.trailer
            self.passing = [torch.empty(size, dtype=torch.uint8) for _ in range(PASSING)]
            self.ctx.account("relay_buffers", +PASSING)
        return self.passing[b % PASSING][: nbytes + self.trailer]

    def _hop(self, group: BroadcastGroup, up: int, down: int, rank: int, deadline: Deadline, poll: Any) -> Group:
        """The pair of chain positions ``up`` and ``down`` (the sender is 0, member i is i; the
        upstream party at rank 0), built once per epoch on the sender's store while this thread
        keeps polling the coordinator. Each position passes buckets on to one other at most."""
        chain = [group.sender, *group.members]
        return self._pair(group, f"hop{up}", [chain[up], chain[down]], rank, deadline, poll)

    def _rows_hop(self, group: BroadcastGroup, sender: int, name: str, head: int, rank: int, deadline: Deadline,
                  poll: Any) -> Group:
        """The pair of trainer rank ``sender`` (named ``name``, at rank 0) and member ``head``
        (one of the first ``group.heads``): that rank's rows of a sharded session."""
        return self._pair(group, f"rows{sender}to{head}", [name, group.members[head - 1]], rank, deadline, poll)

    def _pair(self, group: BroadcastGroup, key: str, names: list[str], rank: int, deadline: Deadline,
              poll: Any) -> Group:
        if self.epoch != (group.nonce, group.epoch):
            self._drop()
            self.epoch = (group.nonce, group.epoch)
        got = self.hops.get(key)
        if got is None:
            prefix = (f"weightsync/{self.ctx.session}/{self.ctx.digest[:16]}/{group.nonce}/epoch{group.epoch}"
                      f"/{key}")
            timeout = max(0.001, min(self.ctx.config.connect_timeout_s, deadline.left()))
            got = self.hops[key] = Group.build_polled("gloo", self._store(), prefix, rank, 2, self.device, timeout,
                                                      names, self.communicator, poll,
                                                      f"building relay {key} of epoch {group.epoch}")
            self.ctx.account("relay_hops", +1)
        return got

    def _drop(self) -> None:
        """Retire the hop groups and, with ops still pending on them, the buffers too."""
        if self.pending:
            self._free_buffers()
        # every hop's retiring thread waits on all the pending ops: an op of one hop may be
        # stuck on a peer that is gone, and a group's last reference, wherever it drops, joins
        # its worker threads only once their ops end (here: off the caller's path)
        for hop in self.hops.values():
            retire(hop, self.pending, self.ctx.name)
            self.ctx.account("relay_hops", -1)
        self.hops, self.pending, self.epoch = {}, [], None

    def _failed(self, version: int, exc: BaseException) -> str:
        return tell_failed(self.ctx, version, exc)

    def _poll(self, version: int) -> None:
        reply = self.ctx.control.bcast_check(version)
        if reply.aborted:
            raise Aborted(f"version {version} was aborted: {reply.aborted}")
        if reply.lost:
            raise VersionError(f"version {version}: relay lost {'; '.join(reply.lost)}")

    def _write_here(self, version: int, slot: int) -> ShmVersion:
        """This host's copy of ``version`` goes into the slot's segment; its followers learn where."""
        where = self.slots.open(version, slot)
        self.ctx.control.segment_at(version, where.segment, where.size)
        return where

    def _free_buffers(self) -> None:
        if self.buffers is not None:
            self.ctx.account("relay_buffers", -BUFFERS)
            self.buffers = None
            self.generation += 1
        if self.passing is not None:
            self.ctx.account("relay_buffers", -PASSING)
            self.passing = None
        self.views.clear()

    def _close_end(self) -> None:
        self._drop()
        self._free_buffers()
        self.slots.close()


class RelaySender(_End, SenderTransport):
    name = "relay"

    def __init__(self, ctx: TransportContext, session: RelaySession | None = None):
        """Rank 0 hosts the session's store; another trainer rank of a sharded session joins
        rank 0's ``session``."""
        if ctx.device.type != "cpu":
            raise ConfigError(f"transport 'relay' moves host memory over gloo; sender '{ctx.name}' runs on "
                              f"{ctx.device.type} (use 'broadcast': its collective relays on the device)")
        self._setup(ctx, f"sender '{ctx.name}'", ctx.config.communicator if session is None else session.communicator)
        if session is None:
            self.store_id = secrets.token_hex(8)
            kind = digest.kind_of(ctx.config, "cpu") if self.trailer else None
            session = RelaySession(communicator=self.communicator, host=store_host(ctx.config.rendezvous_host),
                                   port=self._store().port, store_id=self.store_id, digest_kind=kind,
                                   why="relay: one copy per receiving host, passed host to host")
        else:
            self.store_id = session.store_id
            self.trailer = TRAILER if session.digest_kind else 0  # rank 0's digests, whatever this rank's config
        self.session = session
        self.packed_bytes = 0  # bytes this end packed onto the wire so far: whole buckets, or its rows
        # version -> (its slot, what to send: a Packer, or this rank's RowWriter in a sharded session)
        self.packers: dict[int, tuple[int, Packer | RowWriter]] = {}

    def _store(self) -> dist.TCPStore:
        if self.store is None:
            if self.ctx.rank != 0:
                self.store = connect_store(self.session.host, self.session.port, self.ctx.config.connect_timeout_s)
            else:
                self.store = host_store(store_host(self.ctx.config.rendezvous_host),
                                        self.ctx.config.rendezvous_port, self.ctx.config.connect_timeout_s)
        return self.store

    def stage(self, version: int, slot: int, packer: Packer | RowWriter) -> RelayVersion:
        # the tensors are read at the barrier, as broadcast reads them: two buckets of memory
        self.packers = {v: p for v, p in self.packers.items() if v > version}
        self.packers[version] = (slot, packer)
        return RelayVersion(session=self.session, slot=slot)

    def give_back(self, version: int) -> bool:
        kept = self.packers.pop(version, None)
        if kept is not None:
            kept[1].drain()
        return kept is not None

    def send(self, version: int, deadline: Deadline) -> str | None:
        kept = self.packers.pop(version, None)
        if kept is None:
            raise VersionError(f"version {version} was not staged on the relay transport")
        slot, packer = kept
        group = None
        try:
            group = self.ctx.control.bcast_form(version)
        except VersionError:
            pass  # aborted already; the coordinator has the reason
        except WeightSyncError as exc:
            self._failed(version, exc)
        local = group is not None and group.sender in group.followers.values()
        if group is None or (not group.members and not local):
            if isinstance(packer, Packer):
                packer.drain()  # nobody to send to; the coordinator records the outcome
            return None
        if isinstance(packer, RowWriter):
            try:
                self._send_rows(version, group, packer, deadline)
            except Exception as exc:
                # not raised: sync()'s wait_outcome raises SyncFailed naming every party at fault
                self._failed(version, exc)
                self._drop()
            return None  # the version's digest is the receivers' (of the buckets the heads made whole)
        return self._send(version, group, slot, packer, local, deadline)

    def send_rows(self, version: int, rows: RowWriter, deadline: Deadline) -> RowsSent:
        """A trainer rank other than 0: its rows of ``version``, to the heads, once rank 0
        formed the version's relay at the barrier. A failure is told to the coordinator (which
        aborts the version, naming the party at fault) and raised."""
        try:
            group = self.ctx.control.bcast_group(version, timeout=max(0.001, deadline.left()))
            return self._send_rows(version, group, rows, deadline)
        except VersionError:
            raise  # the version is off: the coordinator has the reason
        except Exception as exc:
            reason = self._failed(version, exc)
            self._drop()
            raise VersionError(f"version {version} was aborted: {reason}") from None

    def _send_rows(self, version: int, group: BroadcastGroup, rows: RowWriter, deadline: Deadline) -> RowsSent:
        """This rank's piece of each bucket it has rows in (``RowWriter.pack``: its rows one
        after another, then their digest), over a pair of its own to each head."""
        kind, me = self.session.digest_kind, rows.rows.rank

        def poll() -> None:
            self._poll(version)

        pieces = [(b, rows.rows.piece_bytes(b)) for b in rows.buckets]
        pieces = [(b, n) for b, n in pieces if n]
        heads = [self._rows_hop(group, me, self.ctx.name, k, 0, deadline, poll)
                 for k in range(1, group.heads + 1)] if pieces else []
        sent: list[list[Any]] = []  # per piece, its send to each head
        sums: list[int] = []
        for i, (b, n) in enumerate(pieces):
            if i >= BUFFERS:
                for w in sent[i - BUFFERS]:
                    settle(w, deadline.at, poll, f"rows of bucket {pieces[i - BUFFERS][0]} of version {version}")
            wire = self._wire(i, n)
            self.packed_bytes += rows.pack(b, wire[:n])
            if self.trailer:
                sums.append(digest.as_int(put_checksum(wire, n, None, kind)))
            sent.append([hop.broadcast(wire, deadline.left()) for hop in heads])
            self.pending.extend(sent[-1])
        for works in sent[-BUFFERS:]:
            for w in works:
                settle(w, deadline.at, poll, f"the last rows of version {version}")
        self.pending = []
        return RowsSent(rank=me, buckets=[b for b, _ in pieces], sums=sums, written=sum(n for _, n in pieces))

    def _send(self, version: int, group: BroadcastGroup, slot: int, packer: Packer, local: bool,
              deadline: Deadline) -> str | None:
        """Pack the version once; each bucket into this host's segment (for the followers here)
        and down the chain. The iteration runs to its end whatever fails (it may be a collective
        the other trainer ranks are in); a failure is recorded, and sync() raises it."""
        plan, kind = packer.plan, self.session.digest_kind

        def poll() -> None:
            self._poll(version)

        hop: Group | None = None
        sent: list[Any] = []
        sums: list[int] = []
        failed: BaseException | None = None
        for b, bucket in enumerate(plan.buckets):
            n = bucket.nbytes
            if failed is None:
                try:
                    if b == 0:
                        if local:
                            self._write_here(version, slot)
                        if group.members:
                            hop = self._hop(group, 0, 1, 0, deadline, poll)
                    if b >= BUFFERS and hop is not None:
                        settle(sent[b - BUFFERS], deadline.at, poll, f"bucket {b - BUFFERS} of version {version}")
                except Exception as exc:
                    failed = exc
            if failed is not None:
                packer.drain()  # the rest of a failed version, walked without a copy
                break
            wire = self._wire(b, n)
            value = packer.fill(b, wire[:n], kind, self.views)  # a tensor off the manifest raises here
            self.packed_bytes += n
            if self.trailer:
                value = digest.as_int(put_checksum(wire, n, value, kind))
                sums.append(value)
            if local:
                self.slots.view(b, n).copy_(wire[:n])
                self.slots.publish(b, n, value if self.trailer else None)
            if hop is not None:
                sent.append(hop.broadcast(wire, deadline.left()))
                self.pending.append(sent[-1])
        if failed is None:
            try:
                for w in sent[-BUFFERS:]:
                    settle(w, deadline.at, poll, f"the last buckets of version {version}")
                self.pending = []
            except Exception as exc:
                failed = exc
        if failed is not None:
            # not raised: sync()'s wait_outcome raises SyncFailed naming every party at fault
            self._failed(version, failed)
            self._drop()
            return None
        return digest.version_digest(kind, sums) if kind else None

    def close(self) -> None:
        self._close_end()
        self.packers.clear()
        self.store = None


class RelayReceiver(_End, ReceiverTransport):
    name = "relay"

    def __init__(self, ctx: TransportContext, session: RelaySession):
        self.session = session
        self._setup(ctx, f"receiver '{ctx.name}'", session.communicator)
        if bool(self.trailer) != bool(session.digest_kind):
            raise ConfigError(f"receiver '{ctx.name}' has checksum={ctx.config.checksum} but the sender "
                              f"{'sends' if session.digest_kind else 'does not send'} digests; use one config for "
                              f"every party")
        self.digest_kind = session.digest_kind if ctx.digest_kind is not None else None
        # this host's copies, read as a shm receiver reads them: a follower's, and the member's own
        # when it loads a version again (rollback)
        self.reader = ShmReceiver(ctx, ShmSession(digest_kind=session.digest_kind))
        self.where: dict[int, ShmVersion] = {}  # version -> where its bytes lie on this host

    def _store(self) -> dist.TCPStore:
        if self.store is None:
            self.store = connect_store(self.session.host, self.session.port, self.ctx.config.connect_timeout_s)
        return self.store

    def _follow(self, info: RelaySession) -> None:
        """A version hosted by another store than ours: the trainer was restarted. Leave the
        dead sender's hops and store; the next ones are built on the new store."""
        if info.store_id == self.session.store_id:
            return
        self._drop()
        self.store = None
        self.session = dataclasses.replace(self.session, host=info.host, port=info.port, store_id=info.store_id)

    def receive(self, version: int, record: VersionRecord, deadline: Deadline) -> Iterator[Bucket]:
        if version in self.where and self.reader.can_replay(version, self.where[version]):
            # complete on this host already: loaded again from the segment (rollback)
            yield from self.reader.receive(version, self.where[version], deadline)
            return
        self._follow(record.session)
        group = self.ctx.control.bcast_group(version, timeout=max(0.001, deadline.left()))
        if group.rank is None:
            at = self.ctx.control.segment_of(version, timeout=max(0.001, deadline.left()))
            # the version's delta record gives the bucket lengths on the wire, as the member wrote them
            where = self.where[version] = ShmVersion(segment=at.ref, size=at.size, delta=record.delta)
            self._keep(version)
            yield from self.reader.receive(version, where, deadline)
            return
        yield from self._relay(version, record, group, deadline)

    def _keep(self, version: int) -> None:
        for old in [v for v in self.where if v < version - self.ctx.config.shm_max_segments]:
            del self.where[old]

    def _relay(self, version: int, record: RelayVersion, group: BroadcastGroup, deadline: Deadline) -> Iterator[Bucket]:
        """A member: each bucket from the party before it in the chain, passed on to the one
        after it, written into this host's segment, and yielded to load."""
        def poll() -> None:
            deadline.check()
            self._poll(version)

        plan = record.moves(self.ctx.plan)  # the wire lengths its record gives
        me = group.rank
        passed: dict[int, Any] = {}
        finished = False
        try:
            # a sharded session: the first ``heads`` members take every trainer rank's rows, each
            # heading a chain of the members after it, ``heads`` apart
            heads = group.heads if self.ctx.manifest.rows is not None else 1
            if me <= heads and self.ctx.manifest.rows is not None:
                def join(r: int) -> Group:
                    return self._rows_hop(group, r, f"trainer rank {r}", me, 1, deadline, poll)

                inflow: WholeIn | RowsIn = RowsIn(self, version, join, deadline, poll, whole_digest=True)
            else:
                inflow = WholeIn(self, version, self._hop(group, me - heads, me, 1, deadline, poll), deadline, poll)
            down = self._hop(group, me, me + heads, 0, deadline, poll) if me + heads <= len(group.members) else None
            self.where[version] = self._write_here(version, record.slot)
            self._keep(version)
            for b in range(min(BUFFERS, plan.bucket_count)):
                inflow.post(b, plan.buckets[b].nbytes)
            for b, bucket in enumerate(plan.buckets):
                n = bucket.nbytes
                wire, expected = inflow.take(b, n)
                if down is not None:  # on while this host loads it, from a copy (PASSING)
                    if b >= PASSING:
                        settle(passed.pop(b - PASSING), deadline.at, poll,
                               f"passing bucket {b - PASSING} of version {version} on")
                    out = self._passing(b, n)
                    out.copy_(wire)
                    passed[b] = down.broadcast(out, deadline.left())
                    self.pending.append(passed[b])
                self.slots.view(b, n).copy_(wire[:n])
                self.slots.publish(b, n, expected)
                yield Bucket(b, wire[:n], expected if self.digest_kind else None, inflow.checked, self.generation)
                if b + BUFFERS < plan.bucket_count:
                    inflow.post(b + BUFFERS, plan.buckets[b + BUFFERS].nbytes)
            inflow.finish()
            for b in sorted(passed):
                settle(passed.pop(b), deadline.at, poll, f"passing bucket {b} of version {version} on")
            self.pending = []
            finished = True
        except VersionError:
            raise  # from the coordinator: the version is off, or this party is not in its relay
        except Exception as exc:  # a hop failed (closed connection, timeout), or a deadline
            reason = self._failed(version, exc)
            kind = DeadlineExceeded if isinstance(exc, DeadlineExceeded) else VersionError
            raise kind(reason if isinstance(exc, Aborted) else f"version {version} was aborted: {reason}") from None
        finally:
            if not finished:
                # stopped part-way (a failure above, or load_weights / a checksum failed in the
                # consumer): the posted ops are out of step with the chain, retire the hops
                self._drop()

    def can_replay(self, version: int, record: VersionRecord) -> bool:
        where = self.where.get(version)
        return where is not None and self.reader.can_replay(version, where)

    def close(self) -> None:
        self.reader.close()
        self._close_end()
        self.store = None

