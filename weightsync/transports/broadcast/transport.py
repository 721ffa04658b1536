"""Internal. Broadcast transport: a collective broadcast from sender rank 0 to every receiver over a
standalone process group, the same code for HCCL (Ascend), NCCL (CUDA) and gloo (CPU).

The group is never the default ``torch.distributed`` world (vLLM and FSDP own it in these
processes): the sender hosts a TCPStore (``store.py``; its address is in the session
record) and every party builds its group on a PrefixStore of it (``groups.py``). Which
communicator carries the bytes (torch gloo / NCCL, torch_npu HCCL, or vLLM's
StatelessProcessGroup + PyHccl / PyNccl) is ``communicators.py``, the only per-backend part;
so the gloo tests run the code that runs on Ascend.

Membership comes from the coordinator: at the barrier the sender fixes the group of the
version (itself as rank 0, the live participants by user rank after it), receivers learn
their group rank from it. The group, its communicator and the bucket buffers are built
once and reused; a new member set or a failed version bumps the epoch and the parties
re-form under a fresh store prefix, so a new group never meets traffic of an old one.

One version, on the wire:
  sender    pack bucket b+1 (the Packer) while bucket b is in flight, two buffers
  receivers post bucket b+1 while bucket b is verified and loaded, two buffers
  each bucket: [payload bytes][8-byte digest of them] (no trailer with digest: off)
Digests: every bucket carries one, verified by every receiver before it loads. On gloo the
bytes cross host memory and TCP, whose 16-bit checksum misses corruption now and then: xxh3
(cheapest on host memory). On NCCL / HCCL the torch digest, computed on the device by both
ends, so no byte goes to the host: link-level CRC does not cover a torn or stale buffer
(a protocol race, a rebuilt communicator). The sender writes its digest into the trailer
with a device copy, without waiting for it.

Failures: every wait polls the coordinator while it is slow. A dead or stalled member turns
into an abort of the version that names it (``bcast_failed``), seen by every party within
the deadline; the broken group is retired (its pending ops finish or time out in the
background, holding their own buffers) and the next version re-forms without the member.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ... import device as devices
from ... import digest
from ...errors import ChecksumError, ConfigError, DeadlineExceeded, VersionError, WeightSyncError
from ...manifest import BucketPlan, Packer, RowWriter
from ...records import BroadcastGroup, VersionRecord
from .. import Aborted, Bucket, Deadline, ReceiverTransport, RowsSent, SenderTransport, Span, TransportContext
from .ahead import AheadCopy
from .communicators import choose_backend
from .ends import BUFFERS, TRAILER, BroadcastEnd, WholeIn, get_checksum, put_checksum  # noqa: F401  (tests)
from .groups import Group, settle
from .records import BroadcastSession, BroadcastVersion
from .rows import RowsIn, send_rows
from .store import connect_store, host_store, store_host


class BroadcastSender(BroadcastEnd, SenderTransport):
    name = "broadcast"

    def __init__(self, ctx: TransportContext, session: BroadcastSession | None = None):
        """Rank 0 hosts the session's store; another trainer rank of a sharded session joins
        rank 0's ``session`` to send its rows (rows.py)."""
        self.ctx = ctx
        self.store: dist.TCPStore | None = None
        self.packers: dict[int, Packer | RowWriter] = {}
        self.packed_bytes = 0  # bytes this end packed onto the wire so far: whole buckets, or its rows
        self.groups_ahead: dict[int, BroadcastGroup | None] = {}  # announced versions: their group (None: gone)
        self.sent_ahead: set[int] = set()
        if session is not None:
            self._setup(ctx, session.backend, f"sender '{ctx.name}'", session.communicator)
            self.trailer = TRAILER if session.digest_kind else 0  # rank 0's digests, whatever this rank's config
            self.store_id, self.session = session.store_id, session
            return
        self._setup(ctx, choose_backend(ctx.config.backend, ctx.device), f"sender '{ctx.name}'")
        kind = digest.kind_of(ctx.config, self.device)  # of the buckets on the communicator's device
        # tells this sender's store from a restarted sender's, even on a fixed rendezvous_port
        self.store_id = secrets.token_hex(8)
        # receive_ahead: send in stage() when every receiver keeps an ahead copy (a sharded
        # session: every rank its rows, in its stage()); announced versions are readable while STAGING
        ahead = ctx.config.receive_ahead != "off" and ctx.control is not None
        self.session = BroadcastSession(backend=self.backend, communicator=self.communicator,
                                        communicator_reason=self.communicator_reason,
                                        host=store_host(ctx.config.rendezvous_host), port=self._store().port,
                                        store_id=self.store_id, digest_kind=kind, ahead=ahead)

    def _store(self) -> dist.TCPStore:
        if self.store is None:
            if self.ctx.rank != 0:
                self.store = connect_store(self.session.host, self.session.port, self.ctx.config.connect_timeout_s)
            else:
                self.store = host_store(store_host(self.ctx.config.rendezvous_host),
                                        self.ctx.config.rendezvous_port, self.ctx.config.connect_timeout_s)
        return self.store

    def announce(self, version: int, slot: int) -> BroadcastVersion | None:
        """With receive_ahead, ask the coordinator to form ``version``'s group now: it does when
        every live receiver keeps an ahead copy and waits for it. Then stage() sends it, and
        receivers' ahead threads join from here on; None: it goes at the barrier."""
        if not self.session.ahead:
            return None
        devices.set_current(self.device)
        try:
            group = self.ctx.control.bcast_form(version, ahead=True)
        except VersionError:
            self.groups_ahead[version] = None  # superseded or aborted meanwhile; nothing to send
            return None
        if group is None:
            return None
        self.groups_ahead[version] = group
        return BroadcastVersion(session=self.session, ahead=True)

    def stage(self, version: int, slot: int, packer: Packer | RowWriter) -> BroadcastVersion:
        # Nothing moves before the barrier unless the version's group formed ahead: the tensors
        # are read, packed and sent in send(), with two buckets of memory instead of a copy of
        # the model. So the trainer must leave them unchanged until sync() returns (the recipe
        # syncs right after the step).
        self.packers = {v: p for v, p in self.packers.items() if v > version}
        self.sent_ahead = {v for v in self.sent_ahead if v > version - 8}
        if version in self.groups_ahead:
            group = self.groups_ahead.pop(version)
            if group is None:
                if isinstance(packer, Packer):
                    packer.drain()
                return BroadcastVersion(session=self.session, ahead=True)
            # a failed transfer is not raised: the version is aborted, naming the fault, and sync() raises it
            if isinstance(packer, RowWriter):  # the other ranks send theirs in their stage() (went_ahead)
                self._send_rows(version, group, packer, self._deadline(version))
                sent = None
            else:
                sent = self._stream(version, group, packer, self._deadline(version))
            self.sent_ahead.add(version)
            return BroadcastVersion(session=self.session, ahead=True, digest=sent)
        self.packers[version] = packer
        # the store's address rides along with every version: a restarted trainer hosts a
        # new store, and receivers still connected to the dead one's follow it (receive())
        return BroadcastVersion(session=self.session)

    def _deadline(self, version: int) -> Deadline:
        return Deadline(version, time.monotonic() + self.ctx.config.sync_timeout_s, self.ctx.control)

    def give_back(self, version: int) -> bool:
        packer = self.packers.pop(version, None)
        if isinstance(packer, Packer):
            packer.drain()
        return packer is not None

    def send(self, version: int, deadline: Deadline) -> str | None:
        if version in self.sent_ahead:
            return None  # its bytes moved in stage(); the receivers only load at the barrier
        packer = self.packers.pop(version, None)
        if packer is None:
            raise VersionError(f"version {version} was not staged on the broadcast transport")
        devices.set_current(self.device)
        group = None
        try:
            group = self.ctx.control.bcast_form(version)
        except VersionError:
            pass  # aborted already; the coordinator has the reason
        except WeightSyncError as exc:
            self._failed(version, exc)
        if group is None or group.size == 1:
            if isinstance(packer, Packer):
                packer.drain()  # nobody to send to; the coordinator records the outcome
            return None
        if isinstance(packer, RowWriter):
            self._send_rows(version, group, packer, deadline)
            return None  # the version's digest is the receivers' (of the pieces' digests)
        return self._stream(version, group, packer, deadline)

    def _send_rows(self, version: int, group: BroadcastGroup, rows: RowWriter, deadline: Deadline) -> None:
        """Rank 0's rows (rows.py). A failure is not raised: the version is aborted, naming the
        fault, and sync()'s wait_outcome raises SyncFailed naming every party at fault."""
        try:
            send_rows(self, version, group, rows, deadline, lambda: self._poll(version))
        except Exception as exc:
            self._failed(version, exc)
            self._drop()

    def went_ahead(self, record: VersionRecord) -> bool:
        return isinstance(record, BroadcastVersion) and record.ahead

    def send_rows(self, version: int, rows: RowWriter, deadline: Deadline) -> RowsSent:
        """A trainer rank other than 0: its rows of ``version``, over its own group, once rank 0
        formed the version's group (at the barrier, or ahead in its stage()). Raises VersionError
        where they could not go (the version is aborted, naming the fault)."""
        devices.set_current(self.device)
        try:
            group = self.ctx.control.bcast_group(version, timeout=max(0.001, deadline.left()))
            return send_rows(self, version, group, rows, deadline, lambda: self._poll(version))
        except VersionError:
            raise  # the version is off: the coordinator has the reason
        except Exception as exc:
            reason = self._failed(version, exc)
            self._drop()
            raise VersionError(f"version {version} was aborted: {reason}") from None

    def _stream(self, version: int, group: BroadcastGroup, packer: Packer, deadline: Deadline) -> str | None:
        """Pack and send the version (_Run); its digest, or None where the transfer failed. The
        iteration always runs to its end, even after the transfer failed: it may be a collective
        on the trainer's own group (FSDP full_tensor) that the other trainer ranks are inside. So
        errors of the transfer are recorded, not raised, in here: sync()'s wait_outcome raises
        SyncFailed with what the coordinator learned, naming every party at fault."""
        devices.set_current(self.device)
        run = _Run(self, version, deadline, packer.plan)
        try:
            run.group = self._join(group, 0, deadline, run.poll)
        except Exception as exc:
            run.fail(exc)
        kind = self.session.digest_kind if self.trailer else None
        try:
            for b in range(packer.plan.bucket_count):
                buf = run.claim(b) if run.error is None else None
                if buf is None:
                    break
                run.done(b, packer.fill(b, buf, kind, self.views))
                self.packed_bytes += packer.plan.buckets[b].nbytes
        except BaseException as exc:
            run.fail(exc)  # the trainer's tensors are off the manifest, or its iteration failed
            raise
        packer.drain()  # the rest of a failed version, walked without a copy
        if run.error is None:
            try:
                return run.finish()
            except Exception as exc:
                run.fail(exc)
        return None

    def close(self) -> None:
        self._close_end()
        self.packers.clear()
        self.store = None


class _Run:
    """One version packed and broadcast. Bucket b's buffer is claimed once every bucket before b
    is fully packed: that is when bucket b-1 is launched and bucket b-2, the buffer's previous
    user, must have left."""

    def __init__(self, sender: BroadcastSender, version: int, deadline: Deadline, plan: BucketPlan):
        self.sender, self.version, self.deadline = sender, version, deadline
        self.plan = plan  # the packer's wire lengths (shorter where its buckets are encoded)
        self.group: Group | None = None
        self.launched: list[Any] = []
        self.digests: dict[int, Any] = {}  # each bucket's, from the packer, until launched
        self.written: list[Any] = []  # the same, in plan order, for the version's digest
        self.error: BaseException | None = None

    def poll(self) -> None:
        self.sender._poll(self.version)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.sender._failed(self.version, exc)  # aborts the version, naming the fault, for everyone
            self.sender._drop()

    def launch_until(self, b: int) -> None:
        s, plan = self.sender, self.plan
        while len(self.launched) < b:
            i = len(self.launched)
            n = plan.buckets[i].nbytes
            if s.trailer:
                self.written.append(put_checksum(s._wire(i, n), n, self.digests.pop(i, None), s.session.digest_kind))
            self.launched.append(self.group.broadcast(s._wire(i, n), self.deadline.left()))
            s.pending.append(self.launched[-1])

    def claim(self, b: int) -> torch.Tensor | None:
        """Bucket b's buffer; None once the transfer failed."""
        try:
            self.launch_until(b)
            if b >= BUFFERS:
                settle(self.launched[b - BUFFERS], self.deadline.at, self.poll,
                       f"bucket {b - BUFFERS} of version {self.version}")
            return self.sender._wire(b, self.plan.buckets[b].nbytes)
        except Exception as exc:
            self.fail(exc)
            return None

    def done(self, b: int, digest: int | torch.Tensor | None) -> None:
        if digest is not None:
            self.digests[b] = digest

    def finish(self) -> str | None:
        """Launch what is left, wait for the last buckets; the version's digest."""
        s, count = self.sender, self.plan.bucket_count
        self.launch_until(count)
        for b in range(max(0, count - BUFFERS), count):
            settle(self.launched[b], self.deadline.at, self.poll, f"bucket {b} of version {self.version}")
        devices.synchronize(s.device)
        s.pending = []
        kind = s.session.digest_kind if s.trailer else None
        # device digests are final after the sync
        return digest.version_digest(kind, [digest.as_int(d) for d in self.written]) if kind else None


class BroadcastReceiver(BroadcastEnd, ReceiverTransport):
    name = "broadcast"

    def __init__(self, ctx: TransportContext, session: BroadcastSession):
        self.ctx, self.session = ctx, session
        sends = bool(session.digest_kind)
        self._setup(ctx, session.backend, f"receiver '{ctx.name}'", session.communicator)
        if bool(self.trailer) != sends:
            raise ConfigError(f"receiver '{ctx.name}' has checksum={ctx.config.checksum} but the sender "
                              f"{'sends' if sends else 'does not send'} digests; use one config for every party")
        self.digest_kind = session.digest_kind if ctx.digest_kind is not None else None
        self.store: dist.TCPStore | None = None
        self.copy: AheadCopy | None = None  # receive_ahead: the version taken before the barrier

    def _store(self) -> dist.TCPStore:
        if self.store is None:
            self.store = connect_store(self.session.host, self.session.port, self.ctx.config.connect_timeout_s)
        return self.store

    def _follow(self, info: BroadcastSession) -> None:
        """A version hosted by another store than ours: the trainer was restarted. Leave the
        dead sender's group and store; the next group is built on the new store."""
        if info.store_id == self.session.store_id:
            return
        sends = bool(info.digest_kind)
        if (info.backend, info.communicator, sends) != (self.backend, self.communicator, bool(self.trailer)):
            raise ConfigError(f"receiver '{self.ctx.name}': the restarted sender uses backend "
                              f"{info.backend!r} ({info.communicator}), checksum={sends}; "
                              f"this receiver was set up for {self.backend!r} ({self.communicator}), "
                              f"checksum={bool(self.trailer)}")
        self._drop()
        self.store = None
        self.session = dataclasses.replace(self.session, host=info.host, port=info.port, store_id=info.store_id)

    def receive(self, version: int, record: VersionRecord, deadline: Deadline) -> Iterator[Bucket]:
        if not record.ahead:
            yield from self._collective(version, record, deadline)
            return
        if self.copy is None:
            raise VersionError(f"version {version} was sent ahead but receiver '{self.ctx.name}' keeps no ahead "
                               f"copy (receive_ahead: off here; use one config for every party)")
        self.copy.wait(version, deadline)
        yield from self.copy.buckets(record.moves(self.ctx.plan))

    def _collective(self, version: int, record: BroadcastVersion, deadline: Deadline) -> Iterator[Bucket]:
        self._follow(record.session)

        def poll() -> None:
            deadline.check()
            self._poll(version)

        devices.set_current(self.device)
        plan = record.moves(self.ctx.plan)  # the wire lengths its record gives
        finished = False
        try:
            group = self.ctx.control.bcast_group(version, timeout=max(0.001, deadline.left()))
            if self.ctx.manifest.rows is not None:  # a sharded session: every rank's rows (rows.py)
                def join(r: int) -> Group:
                    return self._rows_group(group, r, f"trainer rank {r}", group.rank, deadline, poll)

                inflow: WholeIn | RowsIn = RowsIn(self, version, join, deadline, poll)
            else:
                inflow = WholeIn(self, version, self._join(group, group.rank, deadline, poll), deadline, poll)
            if devices.has_streams(self.device):
                # the buffers serve the barrier (the engine's stream) and the ahead thread (a
                # stream of its own, ahead.py): freed with ops of either still queued, their
                # memory must not go to a new tensor before those ops end
                for buf in self._buffers():
                    devices.record_stream(buf, devices.current_stream(self.device))

            for b in range(min(BUFFERS, plan.bucket_count)):
                inflow.post(b, plan.buckets[b].nbytes)
            for b, bucket in enumerate(plan.buckets):
                wire, expected = inflow.take(b, bucket.nbytes)
                yield Bucket(b, wire[: bucket.nbytes], expected if self.digest_kind else None, inflow.checked,
                             self.generation)
                if b + BUFFERS < plan.bucket_count:  # the consumer is done with this buffer
                    inflow.post(b + BUFFERS, plan.buckets[b + BUFFERS].nbytes)
            inflow.finish()
            devices.synchronize(self.device)
            self.pending = []
            finished = True
        except VersionError:
            raise  # from the coordinator: the version is off, or we are not in its group
        except Exception as exc:  # the collective failed (closed connection, timeout), or a deadline
            reason = self._failed(version, exc)
            kind = DeadlineExceeded if isinstance(exc, DeadlineExceeded) else VersionError
            raise kind(reason if isinstance(exc, Aborted) else f"version {version} was aborted: {reason}") from None
        finally:
            if not finished:
                # stopped part-way (a failure above, or load_weights / a checksum failed in
                # the consumer): our posted ops are out of step with the group, retire it
                self._drop()

    # -- receive_ahead: versions sent in stage() --------------------------------------------------

    def open_ahead(self) -> int | None:
        """Allocate the ahead copy where the sender sends ahead; its bytes, or None (not ahead).

        Raises:
            CapacityError: one copy of the payload exceeds ``receive_ahead_max_mb``.
        """
        if not self.session.ahead or self.ctx.config.receive_ahead == "off":
            return None
        if self.copy is None:
            self.copy = AheadCopy(self.ctx.plan, self.device, f"receiver '{self.ctx.name}'", self.ctx.config)
            self.ctx.account("ahead_copy_bytes", +self.copy.nbytes)
        return self.copy.nbytes

    def prefetch(self, version: int, record: VersionRecord, deadline: Deadline) -> bool:
        """Take a version sent ahead into the ahead copy; True if it came in whole and verified.
        A bad bucket does not leave the collective (the other members' transfer goes on); the
        version fails when apply() comes for it. Raises what broke the collective (the version
        is aborted, naming the fault)."""
        if not record.ahead or self.copy is None:
            return False
        copy = self.copy
        bad: BaseException | None = None
        # on a device, the collective, the copies and the digests are queued on the copy's own
        # stream: the engine keeps generating on its stream meanwhile (ahead.py)
        with copy.writing():
            copy.begin(version)
            try:
                for bucket in self._collective(version, record, deadline):
                    into = copy.bucket(bucket.index, bucket.data.numel())
                    into.copy_(bucket.data)
                    expected = None if bucket.digest is None else digest.as_int(bucket.digest)
                    copy.digests.append(expected)
                    if bad is None and expected is not None and not bucket.checked:
                        try:
                            # the copy is what the barrier loads: verify that one, now
                            # (off the barrier: this thread may wait for the device)
                            digest.verify(self.digest_kind, bucket.index, into, expected, version)
                        except ChecksumError as exc:
                            bad = exc
            except BaseException as exc:
                copy.finish(version, exc)
                raise
            copy.finish(version, bad)
        return bad is None

    def received_ahead(self, version: int, record: VersionRecord) -> bool:
        return isinstance(record, BroadcastVersion) and record.ahead

    def span(self, version: int, record: VersionRecord) -> Span | None:
        if self.received_ahead(version, record) and self.copy is not None:
            return self.copy.span()
        return None

    def close(self) -> None:
        self._close_end()
        self.store = None
        if self.copy is not None:
            self.ctx.account("ahead_copy_bytes", -self.copy.nbytes)
            self.copy = None

