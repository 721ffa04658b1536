"""Bounded shm: when whole versions do not fit the node's shared-memory budget, the shm
transport streams each version through a ring of K host bucket buffers instead.

The registry's "shm" entry is :func:`open_shm_sender` / :func:`open_shm_receiver` here: the
mode is decided once, when the sender is built, from the plan and the budget, and receivers
follow the sender's choice as it published it:

  budget     ``shm_budget_mb``, or when 0 (auto) AUTO_FRACTION of what the node can give:
             MemAvailable (or a memory cgroup's room), and for segment files no more than the
             free space of ``shm_dir``; the models beside it need the rest
  whole      when ``shm_max_segments`` x segment size <= budget (a segment: header pages plus
             every bucket page-aligned, one version; see shm/transport.py)
  streaming  otherwise: K = (budget - control block) // bucket buffer (the largest bucket,
             page-aligned), clamped to [2, ipc.wire.MAX_BUFFERS] and to the bucket count; a
             budget without room for 2 buffers is a CapacityError that says what to set

A streaming sender and its receivers each own one end of the ring the ipc transport moves its
versions through (ipc/ring.py: control block, per-receiver release words, the sender overwrites
a buffer only once every participating receiver released it, failed receivers are not waited
for), with K buffers kept in host shared memory even on an accelerator node, so the digest is
xxh3 as for whole versions. It gives up what ipc gives up: nothing is kept (no rollback to the
previous version, a late joiner waits for the next version, the coordinator pins no slot), and
the bytes move in ``sync()``, so the trainer's tensors are read then and must not change until
it returns.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ...config import MiB, SyncConfig
from ...delta.strategy import host_reserve
from ...errors import CapacityError, ProtocolError
from ...plan import BucketPlan, Packing, align_up
from ..base import Received, ReceiverTransport, SenderTransport, TransportContext
from ..ipc.ring import RingReader, RingWriter
from ..ipc.wire import CONTROL_BYTES, MAX_BUFFERS, in_flight
from ..memory import PAGE, memory_available, resolve_backing
from ..records import ShmStreamSession, ShmStreamVersion, ShmVersion, VersionRecord, shm_session, shm_version
from .transport import ShmReceiver, ShmSender, layout

AUTO_FRACTION = 0.5
MIN_BUFFERS = 2  # one being written while receivers read the other
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ShmMode:
    streaming: bool
    buffers: int  # ring slots (streaming); 0 in whole-version mode
    need_bytes: int  # shared memory the mode takes at most: slots x segment, or ring + control block
    reason: str  # shown in status() as part of the transport reason


def size_text(n: float) -> str:
    return f"{n / GiB:.3g} GiB" if n >= GiB else f"{n / MiB:.3g} MiB" if n >= MiB else f"{n / 1024:.3g} KiB"


def node_capacity(config: SyncConfig) -> int:
    """Bytes the node can give to shared memory now: what the kernel can give (MemAvailable, or a
    memory cgroup's room), and for segment files no more than the free space of ``shm_dir``."""
    can = memory_available()[0]
    if resolve_backing(config.shm_backing, config.shm_dir)[0] == "files":
        st = os.statvfs(config.shm_dir)
        can = min(can, st.f_bavail * st.f_frsize)
    return can


def budget(config: SyncConfig, capacity: Callable[[SyncConfig], int] = node_capacity,
           reserve: int = 0) -> tuple[int, str]:
    """(budget in bytes, where it comes from). ``reserve``: host memory the trainer holds
    beside the segments (delta sync's snapshot), taken from what the node can give first."""
    if config.shm_budget_mb > 0:
        return int(config.shm_budget_mb * MiB), f"shm_budget_mb={config.shm_budget_mb:g}"
    can = max(0, capacity(config) - reserve)
    beside = f" beside delta sync's {size_text(reserve)} host snapshot" if reserve else ""
    return int(can * AUTO_FRACTION), f"auto: {AUTO_FRACTION:g} x {size_text(can)} the node can give{beside}"


def choose_mode(plan: BucketPlan, config: SyncConfig, capacity: Callable[[SyncConfig], int] = node_capacity) -> ShmMode:
    # what the sender's packing keeps in host memory on this node comes out of the same budget
    reserve = host_reserve(config.delta, "shm", plan)
    limit, source = budget(config, capacity, reserve)
    segment = layout(plan)[0]
    slots = config.shm_max_segments
    whole = slots * segment
    if whole <= limit:
        return ShmMode(False, 0, whole, f"shm whole versions: {slots} x {size_text(segment)} = {size_text(whole)} "
                                        f"within the budget of {size_text(limit)} ({source})")
    buffer = align_up(max([b.nbytes for b in plan.buckets] + [1]), PAGE)
    control = align_up(CONTROL_BYTES, PAGE)
    fits = max(0, limit - control) // buffer
    if fits < MIN_BUFFERS:
        least = MIN_BUFFERS * buffer + control
        raise CapacityError(
            f"shm: the budget of {size_text(limit)} ({source}) holds neither {slots} whole versions "
            f"({slots} x {size_text(segment)}) nor a ring of {MIN_BUFFERS} bucket buffers of {size_text(buffer)} "
            f"plus a {size_text(control)} control block: set shm_budget_mb >= {math.ceil(least * 100 / MiB) / 100:g}, "
            f"or a smaller "
            f"bucket_mb{', or free memory / grow ' + config.shm_dir if config.shm_budget_mb == 0 else ''}")
    k = max(1, min(fits, in_flight(MAX_BUFFERS), plan.bucket_count))  # WEIGHTSYNC_RING_BUFFERS may cap it to measure
    return ShmMode(True, k, k * buffer + control,
                   f"shm streaming: whole versions need {size_text(whole)} ({slots} x {size_text(segment)}), budget "
                   f"{size_text(limit)} ({source}); ring of {k} x {size_text(buffer)}; keeps no version (no "
                   f"rollback, late joiners wait for the next version, tensors are read during sync())")


class ShmStreamSender(SenderTransport):
    """shm in streaming mode: the writing end of a ring of K host buffers."""

    name = "shm"
    session_record = ShmStreamSession
    version_record = ShmStreamVersion

    def __init__(self, ctx: TransportContext, mode: ShmMode):
        super().__init__(ctx)
        self.mode_reason = mode.reason
        # in host shared memory even on an accelerator node (buffer_device: the host)
        self.ring = RingWriter(ctx, self.name, "shm_ring", self.buffer_device(), mode.buffers, self.digest_kind)

    def session_info(self) -> ShmStreamSession:
        return self.ring.session(ShmStreamSession)

    def stage(self, version: int, slot: int, packing: Packing,
              announce: Callable[[VersionRecord], None]) -> ShmStreamVersion:
        self.ring.stage(version, packing)  # written in send(), at the barrier
        # the rendezvous rides along: receivers of a restarted trainer follow its new ring
        return ShmStreamVersion(session=self.session_info())

    def send(self, version: int, deadline: float) -> None:
        sums = self.ring.send(version, deadline)
        if sums is not None:
            self._record(version, sums)

    def close(self) -> None:
        self.ring.close()


class ShmStreamReceiver(ReceiverTransport):
    """shm in streaming mode: a reading end of the sender's ring, loading onto any device."""

    name = "shm"
    session_record = ShmStreamSession
    version_record = ShmStreamVersion

    def __init__(self, ctx: TransportContext, wire: Mapping[str, Any]):
        super().__init__(ctx, wire)
        self.ring = RingReader(ctx, self.name, "shm_ring", self.session, loads_from_host=True)

    def parse_version(self, wire: Mapping[str, Any]) -> ShmVersion | ShmStreamVersion:
        return shm_version(wire)  # either mode: receive() tells a mode change from a malformed record

    def receive(self, version: int, info: VersionRecord, deadline: float,
                check: Callable[[], None]) -> Iterator[Received]:
        if not isinstance(info, ShmStreamVersion):
            # a restarted trainer that found room for whole versions: this session's receivers
            # were built for the ring
            raise ProtocolError(f"shm: version {version} is published in whole-version mode, but this receiver "
                                f"attached to a streaming session; restart the receiver")
        buckets = self.ring.receive(version, info.session, self.plan_of(info), deadline, check)
        self.kind = self.ring.kind  # a restarted sender's, where the ring followed one
        yield from buckets

    def close(self) -> None:
        self.ring.close()


def open_shm_sender(ctx: TransportContext) -> SenderTransport:
    """The "shm" sender: whole versions where they fit the budget, else the streaming ring."""
    mode = choose_mode(ctx.plan, ctx.config)
    return ShmStreamSender(ctx, mode) if mode.streaming else ShmSender(ctx, mode.reason)


def open_shm_receiver(ctx: TransportContext, wire: Mapping[str, Any]) -> ReceiverTransport:
    """The "shm" receiver of the mode the sender published (its session record's ``mode``)."""
    streaming = isinstance(shm_session(wire), ShmStreamSession)
    return ShmStreamReceiver(ctx, wire) if streaming else ShmReceiver(ctx, wire)
