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
  sender    pack bucket b+1 (pack_stream) while bucket b is in flight, two buffers
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
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ... import device as devices
from ...errors import ConfigError, DeadlineExceeded, VersionError, WeightSyncError
from ...manifest import BucketPlan
from ...packing import BucketSink, Packing
from ...records import BroadcastGroup
from ..base import Aborted, Received, ReceiverTransport, SenderTransport, TransportContext, VersionRecord
from ..shadow import Shadow
from .ahead import AheadReceiver
from .communicators import choose_backend, comm_device
from .ends import BUFFERS, TRAILER, BroadcastEnd, get_checksum, put_checksum  # noqa: F401  (tests)
from .groups import Group, settle
from .records import BroadcastSession, BroadcastVersion
from .store import connect_store, host_store, store_host


class BroadcastSender(BroadcastEnd, SenderTransport):
    name = "broadcast"
    session_record = BroadcastSession
    version_record = BroadcastVersion
    pipelined = False  # bytes move at the barrier, when every receiver is in the collective
    ahead_capable = True  # or in stage(), with receive_ahead, into the receivers' shadows

    def __init__(self, ctx: TransportContext):
        super().__init__(ctx)
        self._setup(ctx, choose_backend(ctx.config.backend, ctx.device), f"sender '{ctx.name}'")
        self.store: dist.TCPStore | None = None
        self.packings: dict[int, Packing] = {}
        self.scratch: torch.Tensor | None = None  # where a failed version's rest is packed
        # tells this sender's store from a restarted sender's, even on a fixed rendezvous_port
        self.store_id = secrets.token_hex(8)
        # receive_ahead: send in stage() when every receiver keeps a shadow; announced versions
        # are readable while STAGING, as on a pipelined transport
        self.ahead = ctx.config.receive_ahead != "off" and ctx.control is not None
        self.pipelined = self.ahead
        self.sent_ahead: set[int] = set()

    def buffer_device(self) -> torch.device:
        return comm_device(choose_backend(self.ctx.config.backend, self.ctx.device), self.ctx.device,
                           f"sender '{self.ctx.name}'")

    def _store(self) -> dist.TCPStore:
        if self.store is None:
            self.store = host_store(store_host(self.ctx.config.rendezvous_host),
                                    self.ctx.config.rendezvous_port, self.ctx.config.connect_timeout_s)
        return self.store

    def session_info(self) -> BroadcastSession:
        return self.session_record(backend=self.backend, communicator=self.communicator,
                                   communicator_reason=self.communicator_reason,
                                   host=store_host(self.ctx.config.rendezvous_host), port=self._store().port,
                                   store_id=self.store_id, digest_kind=self.digest_kind, ahead=self.ahead)

    def stage(self, version: int, slot: int, packing: Packing,
              announce: Callable[[VersionRecord], None]) -> BroadcastVersion:
        # Nothing moves before the barrier: the tensors are read, packed and sent in send(),
        # with two buckets of memory instead of a copy of the model. So the trainer must
        # leave them unchanged until sync() returns (the recipe syncs right after the step).
        self.packings = {v: p for v, p in self.packings.items() if v > version}
        self.sent_ahead = {v for v in self.sent_ahead if v > version - 8}
        if self.ahead and self._send_ahead(version, packing, announce):
            return self.version_record(session=self.session_info(), ahead=True)
        self.packings[version] = packing
        # the store's address rides along with every version: a restarted trainer hosts a
        # new store, and receivers still connected to the dead one's follow it (receive())
        return self.version_record(session=self.session_info())

    def _send_ahead(self, version: int, packing: Packing, announce: Callable[[VersionRecord], None]) -> bool:
        """Send ``version`` now, into every receiver's shadow, if the coordinator forms its group
        ahead (every live receiver keeps a shadow and waits for it); False: at the barrier.
        A failed transfer is not raised: the version is aborted, naming the fault, and
        sync() raises it."""
        devices.set_current(self.device)
        try:
            group = self.ctx.control.bcast_form(version, ahead=True)
        except VersionError:
            self._drain(packing)  # superseded or aborted meanwhile; nothing to send
            return True
        if group is None:
            return False
        # readable from here on: receivers' ahead threads join the group formed above
        announce(self.version_record(session=self.session_info(), ahead=True))
        self._stream(version, group, packing, time.monotonic() + self.ctx.config.sync_timeout_s)
        self.sent_ahead.add(version)
        return True

    def give_back(self, version: int) -> bool:
        packing = self.packings.pop(version, None)
        if packing is not None:
            self._drain(packing)
        return packing is not None

    def send(self, version: int, deadline: float) -> None:
        if version in self.sent_ahead:
            return  # its bytes moved in stage(); the receivers only load at the barrier
        packing = self.packings.pop(version, None)
        if packing is None:
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
            self._drain(packing)  # nobody to send to; the coordinator records the outcome
            return
        self._stream(version, group, packing, deadline)

    def _stream(self, version: int, group: BroadcastGroup, packing: Packing, deadline: float) -> None:
        """Pack and send the version (_Launch). The iteration always runs to its end, even
        after the transfer failed: it may be a collective on the trainer's own group (FSDP
        full_tensor) that the other trainer ranks are inside. So errors of the transfer are
        recorded, not raised, in there."""
        run = _Launch(self, version, deadline, plan=packing.plan)
        try:
            run.group = self._join(group, 0, deadline, run.poll)
        except Exception as exc:
            run.fail(exc)
        try:
            for _ in packing.into(run, self.digest_kind if self.trailer else None):
                pass
        except BaseException as exc:
            run.fail(exc)  # the trainer's tensors are off the manifest, or its iteration failed
            raise
        if run.error is None:
            try:
                run.finish()
            except Exception as exc:
                run.fail(exc)
        # a failed transfer is not raised here: sync()'s wait_outcome raises SyncFailed
        # with what the coordinator learned, naming every party at fault

    def _scratch(self) -> torch.Tensor:
        if self.scratch is None:
            self.scratch = torch.empty(self.ctx.plan.bucket_bytes + self.trailer, dtype=torch.uint8,
                                       device=self.device)
        return self.scratch

    def _drain(self, packing: Packing) -> None:
        """Iterate the version without sending: the iteration may be a collective on the
        trainer's own group (FSDP full_tensor), which the other ranks are inside."""
        try:
            for _ in packing.into(_Launch(self, -1, 0.0, failed=True), None):
                pass
        except Exception:
            pass  # the version has already failed; the first error is the one reported

    def close(self) -> None:
        self._close_end()
        self.packings.clear()
        self.scratch = self.store = None


class _Launch(BucketSink):
    """One version packed and broadcast. pack_stream asks for bucket b's buffer only once every
    bucket before b is fully packed: that is when bucket b-1 is launched and bucket b-2, the
    buffer's previous user, must have left. A tensor larger than a bucket spans several, so a
    yield from pack_stream comes too late to be the signal. Once the transfer failed, the
    rest of the version is packed into scratch."""

    def __init__(self, sender: BroadcastSender, version: int, deadline: float, failed: bool = False,
                 plan: BucketPlan | None = None):
        self.sender, self.version, self.deadline = sender, version, deadline
        self.views = sender.views
        self.plan = sender.ctx.plan if plan is None else plan  # the packing's wire lengths (shorter where its buckets are encoded)
        self.group: Group | None = None
        self.launched: list[Any] = []
        self.digests: dict[int, Any] = {}  # each bucket's, from pack_stream, until launched
        self.written: list[Any] = []  # the same, in plan order, for the version's digest
        self.error: BaseException | None = Aborted("draining") if failed else None

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
                self.written.append(put_checksum(s._wire(i, n), n, self.digests.pop(i, None), s.digest_kind))
            self.launched.append(self.group.broadcast(s._wire(i, n), self.deadline - time.monotonic()))
            s.pending.append(self.launched[-1])

    def buffer(self, b: int) -> torch.Tensor:
        if self.error is None:
            try:
                self.launch_until(b)
                if b >= BUFFERS:
                    settle(self.launched[b - BUFFERS], self.deadline, self.poll,
                           f"bucket {b - BUFFERS} of version {self.version}")
                return self.sender._wire(b, self.plan.buckets[b].nbytes)
            except Exception as exc:
                self.fail(exc)
        return self.sender._scratch()

    def done(self, b: int, digest: int | torch.Tensor | None) -> None:
        if digest is not None:
            self.digests[b] = digest

    def finish(self) -> None:
        """Launch what is left, wait for the last buckets, record the version's digest."""
        s, count = self.sender, self.plan.bucket_count
        self.launch_until(count)
        for b in range(max(0, count - BUFFERS), count):
            settle(self.launched[b], self.deadline, self.poll, f"bucket {b} of version {self.version}")
        devices.synchronize(s.device)
        s.pending = []
        s._record(self.version, self.written)  # device digests are final after the sync


class BroadcastReceiver(AheadReceiver, BroadcastEnd, ReceiverTransport):
    name = "broadcast"
    session_record = BroadcastSession
    version_record = BroadcastVersion

    def __init__(self, ctx: TransportContext, wire: Mapping[str, Any]):
        super().__init__(ctx, wire)
        sends = bool(self.session.digest_kind)
        self._setup(ctx, self.session.backend, f"receiver '{ctx.name}'", self.session.communicator)
        if bool(self.trailer) != sends:
            raise ConfigError(f"receiver '{ctx.name}' has checksum={ctx.config.checksum} but the sender "
                              f"{'sends' if sends else 'does not send'} digests; use one config for every party")
        self.store: dist.TCPStore | None = None
        self.shadow: Shadow | None = None  # receive_ahead: the version taken before the barrier (ahead.py)

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

    def _collective(self, version: int, info: BroadcastVersion, deadline: float,
                    check: Callable[[], None]) -> Iterator[Received]:
        self._follow(info.session)

        def poll() -> None:
            try:
                check()
            except VersionError as exc:
                raise Aborted(str(exc)) from None
            self._poll(version)

        devices.set_current(self.device)
        plan = self.plan_of(info)  # the wire lengths its record gives
        posted: dict[int, Any] = {}
        finished = False
        try:
            left = max(0.001, deadline - time.monotonic())
            group = self.ctx.control.bcast_group(version, timeout=left)
            g = self._join(group, group.rank, deadline, poll)
            if devices.has_streams(self.device):
                # the buffers serve the barrier (the engine's stream) and the ahead thread (a
                # stream of its own, shadow.py): freed with ops of either still queued, their
                # memory must not go to a new tensor before those ops end
                for buf in self._buffers():
                    devices.record_stream(buf, devices.current_stream(self.device))

            def post(b: int) -> None:
                if b < plan.bucket_count:
                    posted[b] = g.broadcast(self._wire(b, plan.buckets[b].nbytes), deadline - time.monotonic())
                    self.pending.append(posted[b])

            for b in range(BUFFERS):
                post(b)
            for b, bucket in enumerate(plan.buckets):
                settle(posted.pop(b), deadline, poll, f"bucket {b} of version {version}")
                wire = self._wire(b, bucket.nbytes)
                expected = get_checksum(wire, bucket.nbytes) if self.trailer else None
                yield b, wire[: bucket.nbytes], expected
                post(b + BUFFERS)  # the consumer is done with this buffer
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

    def buffers_generation(self) -> int:
        return self.generation

    def close(self) -> None:
        self._close_end()
        self.store = None
        if self.shadow is not None:
            self.ctx.account("ahead_shadow_bytes", -self.shadow.nbytes)
            self.shadow = None
