"""Internal. What both ends of the broadcast transport (broadcast/transport.py) share: the bucket's
digest trailer, the session's store, the current group and the two bucket buffers."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import torch

from ...digest import compute, kind_of
from ...errors import ChecksumError, ConfigError, ProtocolError, WeightSyncError
from ...manifest import PackViews
from ...records import BroadcastGroup
from .. import Aborted, Deadline, TransportContext
from ..ipc.wire import in_flight
from .communicators import choose_communicator, comm_device
from .groups import Group, retire, settle

TRAILER = 8  # bytes of the digest that follows a bucket's payload
# per side: one bucket in flight while the other is packed (or loaded); see in_flight in transports/ipc/wire.py
BUFFERS = in_flight(2)


def put_checksum(buf: torch.Tensor, n: int, value: int | torch.Tensor | None = None,
                 kind: str = "xxh3") -> int | torch.Tensor:
    """Append the bucket's digest (``value`` if the packer computed it already) as a
    trailer. A device value is copied on the device: nothing waits for it."""
    value = compute(kind, buf[:n]) if value is None else value
    if isinstance(value, torch.Tensor):
        # little-endian int64 bytes, as struct writes them below (every device torch runs on)
        buf[n: n + TRAILER].copy_(value.reshape(1).view(torch.uint8))
    else:
        buf[n: n + TRAILER].copy_(torch.frombuffer(bytearray(struct.pack("<Q", value)), dtype=torch.uint8))
    return value


def get_checksum(buf: torch.Tensor, n: int) -> int | torch.Tensor:
    """The trailer's digest: an int from host memory; from a device buffer a copy of it on the
    device (the buffer takes the next bucket soon), read with the version's other digests at
    its end (digest.Checks) instead of a host wait per bucket."""
    if buf.device.type != "cpu":
        return buf[n: n + TRAILER].clone().view(torch.int64)[0]
    return struct.unpack("<Q", buf[n: n + TRAILER].numpy().tobytes())[0]


def tell_failed(ctx: TransportContext, version: int, exc: BaseException) -> str:
    """A member's collective failed: tell the coordinator and return the abort reason, which
    names the party at fault (broadcast's group and relay's hops alike)."""
    if isinstance(exc, Aborted):
        return str(exc)
    try:
        # a killed peer may show as silent only after the heartbeat timeout: give the coordinator
        # that long to name it; bytes whose digest is off name their own fault, nobody to wait for
        wait_s = ctx.config.heartbeat_timeout_s + 2 * ctx.config.heartbeat_interval_s
        wait_s = 0.0 if isinstance(exc, ChecksumError) else wait_s
        return ctx.control.bcast_failed(version, f"{type(exc).__name__}: {exc}"[:2000], timeout=wait_s)
    except WeightSyncError as why:
        return f"{type(exc).__name__}: {exc} (and the coordinator could not be told: {why})"


class BroadcastEnd:
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
        self.row_groups: dict[int, Group] = {}  # a sharded session's: trainer rank -> its group
        self.buffers: list[torch.Tensor] | None = None
        self.generation = 0  # bumped whenever the buffers go (Bucket.generation)
        self.views = PackViews()  # the sender's: where each bucket's tensors go in each buffer
        self.pending: list[Any] = []  # ops posted and not yet settled

    def _buffers(self) -> list[torch.Tensor]:
        if self.buffers is None:
            size = self.ctx.plan.bucket_bytes + self.trailer
            self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(BUFFERS)]
            self.ctx.account("bcast_buffers", +BUFFERS)
        return self.buffers

    def _wire(self, b: int, nbytes: int | None = None) -> torch.Tensor:
        """Bucket b's buffer with its trailer: ``nbytes`` of payload (the version's wire
        length), the session plan's by default."""
        n = self.ctx.plan.buckets[b].nbytes if nbytes is None else nbytes
        return self._buffers()[b % BUFFERS][: n + self.trailer]

    def _join(self, group: BroadcastGroup, rank: int, deadline: Deadline, poll: Callable[[], None]) -> Group:
        """The group of this version: the current one if the epoch is unchanged, else built
        anew in a helper thread while this one keeps polling the coordinator."""
        if self.group is None or self.group.epoch != (group.nonce, group.epoch):
            self._drop()
            self.group = self._build(group, "", group.sender, rank, deadline, poll)
        return self.group

    def _rows_group(self, group: BroadcastGroup, sender: int, name: str, rank: int, deadline: Deadline,
                    poll: Callable[[], None]) -> Group:
        """A sharded session's group of trainer rank ``sender`` (named ``name``, at rank 0) and
        every member of the version's group after it, at their ranks there: that rank's rows."""
        if any(g.epoch != (group.nonce, group.epoch) for g in self.row_groups.values()):
            self._drop()  # a new epoch (a new member set, or a failed version): its groups anew
        got = self.row_groups.get(sender)
        if got is None:
            got = self.row_groups[sender] = self._build(group, f"/rows{sender}", name, rank, deadline, poll)
        return got

    def _build(self, group: BroadcastGroup, key: str, root: str, rank: int, deadline: Deadline,
               poll: Callable[[], None]) -> Group:
        # epochs count from 1 again in a restarted coordinator: its nonce keeps names unique
        names = [root] + list(group.members)
        prefix = f"weightsync/{self.ctx.session}/{self.ctx.digest[:16]}/{group.nonce}/epoch{group.epoch}{key}"
        timeout = max(0.001, min(self.ctx.config.connect_timeout_s, deadline.left()))
        built = Group.build_polled(self.backend, self._store(), prefix, rank, len(names), self.device,
                                   timeout, names, self.communicator, poll,
                                   f"building broadcast group{key} epoch {group.epoch}")
        built.epoch = (group.nonce, group.epoch)
        self.ctx.account("bcast_groups", +1)
        return built

    def _drop(self) -> None:
        """Retire the groups and, if ops are still pending on them, the buffers too."""
        if self.pending and self.buffers is not None:
            self.ctx.account("bcast_buffers", -BUFFERS)
            self.buffers = None
            self.generation += 1
            self.views.clear()
        # every group's retiring thread waits on all the pending ops: an op of one group may be
        # stuck on a peer that is gone
        groups = [*([self.group] if self.group is not None else []), *self.row_groups.values()]
        for g in groups:
            self.ctx.account("bcast_groups", -1)
            retire(g, self.pending, self.ctx.name)
        if not groups:
            retire(None, self.pending, self.ctx.name)
        self.group, self.row_groups, self.pending = None, {}, []

    def _failed(self, version: int, exc: BaseException) -> str:
        return tell_failed(self.ctx, version, exc)

    def _poll(self, version: int) -> None:
        reply = self.ctx.control.bcast_check(version)
        if reply.aborted:
            raise Aborted(f"version {version} was aborted: {reply.aborted}")
        if reply.lost:
            # not an abort yet: whoever sees it first aborts the version with this reason
            raise ProtocolError(f"version {version}: broadcast group lost {'; '.join(reply.lost)}")

    def _close_end(self) -> None:
        self._drop()
        if self.buffers is not None:
            self.ctx.account("bcast_buffers", -BUFFERS)
            self.buffers = None
            self.generation += 1
            self.views.clear()


class WholeIn:
    """A receiving end's buckets as one group sends them whole, each with its digest in the
    trailer: broadcast's from sender rank 0, relay's from the party before it in the chain."""

    checked = ""  # the receiver checks each bucket against the digest that came with it

    def __init__(self, end: Any, version: int, group: Group, deadline: Deadline, poll: Callable[[], None]):
        self.end, self.version, self.group, self.deadline, self.poll = end, version, group, deadline, poll
        self.posted: dict[int, Any] = {}

    def post(self, b: int, n: int) -> None:
        self.posted[b] = self.group.broadcast(self.end._wire(b, n), self.deadline.left())
        self.end.pending.append(self.posted[b])

    def take(self, b: int, n: int) -> tuple[torch.Tensor, Any]:
        """Bucket ``b`` (``n`` bytes) with its trailer, and the digest that came with it (None: digests off)."""
        settle(self.posted.pop(b), self.deadline.at, self.poll, f"bucket {b} of version {self.version}")
        wire = self.end._wire(b, n)
        return wire, get_checksum(wire, n) if self.end.trailer else None

    def finish(self) -> None:
        pass
