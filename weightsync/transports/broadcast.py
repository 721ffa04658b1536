"""Broadcast transport: a collective broadcast from sender rank 0 to every receiver over a
standalone process group, the same code for HCCL (Ascend), NCCL (CUDA) and gloo (CPU).

The group is never the default ``torch.distributed`` world (vLLM and FSDP own it in these
processes): the sender hosts a TCPStore (address published in ``session_info``) and every
party builds its group on a PrefixStore of it. How it is built (torch gloo / NCCL,
torch_npu HCCL, or vLLM's StatelessProcessGroup + PyHccl / PyNccl) is :mod:`.groups`, the
only per-backend part; so the gloo tests run the code that runs on Ascend.

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

import secrets
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import device as devices
from ..digest import compute, kind_of
from ..errors import ConfigError, DeadlineExceeded, ProtocolError, VersionError, WeightSyncError
from .base import Aborted, Fill, Received, ReceiverTransport, SenderTransport, TransportContext
from .communicators import choose_backend, choose_communicator, comm_device
from .group_store import connect_store, host_store, store_host
from .groups import Group, retire, settle

TRAILER = 8  # bytes of the digest that follows a bucket's payload
BUFFERS = 2  # per side: one bucket in flight while the other is packed (or loaded)


def put_checksum(buf: torch.Tensor, n: int, value: int | torch.Tensor | None = None,
                 kind: str = "xxh3") -> int | torch.Tensor:
    """Append the bucket's digest (``value`` if pack_stream computed it already) as a
    trailer. A device value is copied on the device: nothing waits for it."""
    value = compute(kind, buf[:n]) if value is None else value
    if isinstance(value, torch.Tensor):
        # little-endian int64 bytes, as struct writes them below (every device torch runs on)
        buf[n: n + TRAILER].copy_(value.reshape(1).view(torch.uint8))
    else:
        buf[n: n + TRAILER].copy_(torch.frombuffer(bytearray(struct.pack("<Q", value)), dtype=torch.uint8))
    return value


def get_checksum(buf: torch.Tensor, n: int) -> int:
    return struct.unpack("<Q", buf[n: n + TRAILER].cpu().numpy().tobytes())[0]


# -- the two ends ----------------------------------------------------------------------


class _End:
    """What both ends share: the session's store, the current group, the two buffers."""

    def _setup(self, ctx: TransportContext, backend: str, who: str, communicator: str | None = None) -> None:
        self.backend = backend
        self.device = comm_device(backend, ctx.device, who)
        # the sender picks the construction; a receiver builds the same one or fails to register
        try:
            self.communicator, self.communicator_reason = choose_communicator(
                communicator or ctx.config.communicator, backend)
        except ConfigError as exc:
            raise ConfigError(f"{who}: {exc}") from None
        self.trailer = TRAILER if kind_of(ctx.config, self.device) else 0
        self.group: Group | None = None
        self.buffers: list[torch.Tensor] | None = None
        self.pending: list[Any] = []  # ops posted and not yet settled

    def _buffers(self) -> list[torch.Tensor]:
        if self.buffers is None:
            size = self.ctx.plan.bucket_bytes + self.trailer
            self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(BUFFERS)]
            self.ctx.account("bcast_buffers", +BUFFERS)
        return self.buffers

    def _wire(self, b: int) -> torch.Tensor:
        return self._buffers()[b % BUFFERS][: self.ctx.plan.buckets[b].nbytes + self.trailer]

    def _join(self, group: dict[str, Any], rank: int, deadline: float, poll: Callable[[], None]) -> Group:
        """The group of this version: the current one if the epoch is unchanged, else built
        anew in a helper thread while this one keeps polling the coordinator."""
        # epochs count from 1 again in a restarted coordinator: its nonce keeps names unique
        ident = (group.get("nonce"), group["epoch"])
        if self.group is not None and self.group.epoch == ident:
            return self.group
        self._drop()
        names = [group["sender"]] + list(group["members"])
        prefix = f"weightsync/{self.ctx.session}/{self.ctx.digest[:16]}/{group.get('nonce')}/epoch{group['epoch']}"
        timeout = max(0.001, min(self.ctx.config.connect_timeout_s, deadline - time.monotonic()))
        self.group = Group.build_polled(self.backend, self._store(), prefix, rank, len(names), self.device,
                                        timeout, names, self.communicator, poll,
                                        f"building broadcast group epoch {group['epoch']}")
        self.group.epoch = ident
        self.ctx.account("bcast_groups", +1)
        return self.group

    def _drop(self) -> None:
        """Retire the group and, if ops are still pending on them, the buffers too."""
        if self.group is not None:
            self.ctx.account("bcast_groups", -1)
        if self.pending and self.buffers is not None:
            self.ctx.account("bcast_buffers", -BUFFERS)
            self.buffers = None
        retire(self.group, self.pending, self.ctx.name)
        self.group, self.pending = None, []

    def _failed(self, version: int, exc: BaseException) -> str:
        """Tell the coordinator; returns the abort reason, which names the party at fault."""
        if isinstance(exc, Aborted):
            return str(exc)
        try:
            wait_s = self.ctx.config.heartbeat_timeout_s + 2 * self.ctx.config.heartbeat_interval_s
            return self.ctx.control.bcast_failed(version, f"{type(exc).__name__}: {exc}"[:2000], timeout=wait_s)
        except WeightSyncError as why:
            return f"{type(exc).__name__}: {exc} (and the coordinator could not be told: {why})"

    def _poll(self, version: int) -> None:
        reply = self.ctx.control.bcast_check(version)
        if reply["aborted"]:
            raise Aborted(f"version {version} was aborted: {reply['aborted']}")
        if reply["lost"]:
            # not an abort yet: whoever sees it first aborts the version with this reason
            raise ProtocolError(f"version {version}: broadcast group lost {'; '.join(reply['lost'])}")

    def _close_end(self) -> None:
        self._drop()
        if self.buffers is not None:
            self.ctx.account("bcast_buffers", -BUFFERS)
            self.buffers = None


class BroadcastSender(_End, SenderTransport):
    name = "broadcast"
    pipelined = False  # bytes move at the barrier, when every receiver is in the collective

    def __init__(self, ctx: TransportContext):
        super().__init__(ctx)
        self._setup(ctx, choose_backend(ctx.config.backend, ctx.device), f"sender '{ctx.name}'")
        self.store: dist.TCPStore | None = None
        self.fills: dict[int, Fill] = {}
        self.scratch: torch.Tensor | None = None  # where a failed version's rest is packed
        # tells this sender's store from a restarted sender's, even on a fixed rendezvous_port
        self.store_id = secrets.token_hex(8)

    def buffer_device(self) -> torch.device:
        return comm_device(choose_backend(self.ctx.config.backend, self.ctx.device), self.ctx.device,
                           f"sender '{self.ctx.name}'")

    def _store(self) -> dist.TCPStore:
        if self.store is None:
            self.store = host_store(store_host(self.ctx.config.rendezvous_host),
                                    self.ctx.config.rendezvous_port, self.ctx.config.connect_timeout_s)
        return self.store

    def session_info(self) -> dict[str, Any]:
        store = self._store()
        return {"backend": self.backend, "communicator": self.communicator,
                "communicator_reason": self.communicator_reason, "host": store_host(self.ctx.config.rendezvous_host),
                "port": store.port, "store_id": self.store_id,
                "digest_kind": self.digest_kind}

    def stage(self, version: int, slot: int, fill: Fill, announce: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        # Nothing moves before the barrier: the tensors are read, packed and sent in send(),
        # with two buckets of memory instead of a copy of the model. So the trainer must
        # leave them unchanged until sync() returns (the recipe syncs right after the step).
        self.fills = {v: f for v, f in self.fills.items() if v > version}
        self.fills[version] = fill
        # the store's address rides along with every version: a restarted trainer hosts a
        # new store, and receivers still connected to the dead one's follow it (receive())
        return self.session_info()

    def send(self, version: int, deadline: float) -> None:
        fill = self.fills.pop(version, None)
        if fill is None:
            raise VersionError(f"version {version} was not staged on the broadcast transport")
        devices.set_current(self.device)
        group = None
        try:
            group = self.ctx.control.bcast_form(version)
        except VersionError:
            pass  # aborted already; the coordinator has the reason
        except WeightSyncError as exc:
            self._failed(version, exc)
        if group is None or group["size"] == 1:
            self._drain(fill)  # nobody to send to; the coordinator records the outcome
            return
        self._stream(version, group, fill, deadline)

    def _stream(self, version: int, group: dict[str, Any], fill: Fill, deadline: float) -> None:
        """Pack and send the version. pack_stream asks for bucket b's buffer only once every
        bucket before b is fully packed: that is when bucket b-1 is launched and bucket b-2,
        the buffer's previous user, must have left. A tensor larger than a bucket spans
        several, so a yield from pack_stream comes too late to be the signal.

        The iteration always runs to its end, even after the transfer failed: it may be a
        collective on the trainer's own group (FSDP full_tensor) that the other trainer
        ranks are inside. So errors of the transfer are recorded, not raised, in there."""
        plan = self.ctx.plan
        poll = lambda: self._poll(version)  # noqa: E731
        launched: list[Any] = []
        sums: dict[int, Any] = {}  # each bucket's digest, computed by pack_stream while packing
        kind = self.digest_kind
        written: list[Any] = []  # the same, in plan order, for the version's digest
        error: BaseException | None = None
        g: Group | None = None

        def fail(exc: BaseException) -> None:
            nonlocal error
            if error is None:
                error = exc
                self._failed(version, exc)  # aborts the version, naming the fault, for everyone
                self._drop()

        def launch_until(b: int) -> None:
            while len(launched) < b:
                i = len(launched)
                if self.trailer:
                    written.append(put_checksum(self._wire(i), plan.buckets[i].nbytes, sums.pop(i, None), kind))
                if self.on_packed is not None:
                    self.on_packed(version, i, self._wire(i)[: plan.buckets[i].nbytes])
                launched.append(g.broadcast(self._wire(i), deadline - time.monotonic()))
                self.pending.append(launched[-1])

        def bucket_buffer(b: int) -> torch.Tensor:
            if error is None:
                try:
                    launch_until(b)
                    if b >= BUFFERS:
                        settle(launched[b - BUFFERS], deadline, poll, f"bucket {b - BUFFERS} of version {version}")
                    return self._wire(b)
                except Exception as exc:
                    fail(exc)
            return self._scratch()

        try:
            g = self._join(group, 0, deadline, poll)
        except Exception as exc:
            fail(exc)
        try:
            for _ in fill(bucket_buffer, sums if self.trailer else None, kind or "xxh3"):
                pass
        except BaseException as exc:
            fail(exc)  # the trainer's tensors are off the manifest, or its iteration failed
            raise
        if error is None:
            try:
                launch_until(plan.bucket_count)
                for b in range(max(0, plan.bucket_count - BUFFERS), plan.bucket_count):
                    settle(launched[b], deadline, poll, f"bucket {b} of version {version}")
                devices.synchronize(self.device)
                self.pending = []
                self._record(version, written)  # device digests are final after the sync
            except Exception as exc:
                fail(exc)
        # a failed transfer is not raised here: sync()'s wait_outcome raises SyncFailed
        # with what the coordinator learned, naming every party at fault

    def _scratch(self) -> torch.Tensor:
        if self.scratch is None:
            self.scratch = torch.empty(self.ctx.plan.bucket_bytes + self.trailer, dtype=torch.uint8,
                                       device=self.device)
        return self.scratch

    def _drain(self, fill: Fill) -> None:
        """Iterate the version without sending: the iteration may be a collective on the
        trainer's own group (FSDP full_tensor), which the other ranks are inside."""
        try:
            for _ in fill(lambda b: self._scratch()):
                pass
        except Exception:
            pass  # the version has already failed; the first error is the one reported

    def close(self) -> None:
        self._close_end()
        self.fills.clear()
        self.scratch = self.store = None


class BroadcastReceiver(_End, ReceiverTransport):
    name = "broadcast"

    def __init__(self, ctx: TransportContext, session_info: dict[str, Any]):
        super().__init__(ctx, session_info)
        self._setup(ctx, session_info["backend"], f"receiver '{ctx.name}'", session_info.get("communicator", "torch"))
        if bool(self.trailer) != bool(session_info.get("digest_kind")):
            raise ConfigError(f"receiver '{ctx.name}' has checksum={ctx.config.checksum} but the sender "
                              f"{'sends' if session_info.get('digest_kind') else 'does not send'} digests; "
                              f"use one config for every party")
        self.store: dist.TCPStore | None = None

    def _store(self) -> dist.TCPStore:
        if self.store is None:
            info = self.session_info
            self.store = connect_store(info["host"], info["port"], self.ctx.config.connect_timeout_s)
        return self.store

    def _follow(self, info: dict[str, Any]) -> None:
        """A version hosted by another store than ours: the trainer was restarted. Leave the
        dead sender's group and store; the next group is built on the new store."""
        if info.get("store_id") in (None, self.session_info.get("store_id")):
            return
        sends = bool(info.get("digest_kind"))
        if (info.get("backend", self.backend), info.get("communicator", self.communicator), sends) \
                != (self.backend, self.communicator, bool(self.trailer)):
            raise ConfigError(f"receiver '{self.ctx.name}': the restarted sender uses backend "
                              f"{info.get('backend')!r} ({info.get('communicator')}), checksum={sends}; "
                              f"this receiver was set up for {self.backend!r} ({self.communicator}), "
                              f"checksum={bool(self.trailer)}")
        self._drop()
        self.store = None
        self.session_info = {**self.session_info, **{k: info[k] for k in ("host", "port", "store_id")}}

    def receive(self, version: int, info: dict[str, Any], deadline: float,
                check: Callable[[], None]) -> Iterator[Received]:
        self._follow(info)

        def poll() -> None:
            try:
                check()
            except VersionError as exc:
                raise Aborted(str(exc)) from None
            self._poll(version)

        devices.set_current(self.device)
        plan = self.ctx.plan
        posted: dict[int, Any] = {}
        finished = False
        try:
            left = max(0.001, deadline - time.monotonic())
            group = self.ctx.control.bcast_group(version, timeout=left)
            g = self._join(group, group["rank"], deadline, poll)

            def post(b: int) -> None:
                if b < plan.bucket_count:
                    posted[b] = g.broadcast(self._wire(b), deadline - time.monotonic())
                    self.pending.append(posted[b])

            for b in range(BUFFERS):
                post(b)
            for b, bucket in enumerate(plan.buckets):
                settle(posted.pop(b), deadline, poll, f"bucket {b} of version {version}")
                wire = self._wire(b)
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

    def close(self) -> None:
        self._close_end()
        self.store = None
