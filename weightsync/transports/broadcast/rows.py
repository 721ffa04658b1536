"""Internal. A sharded session on the broadcast transport (docs/sharded.md): every trainer rank
broadcasts its own rows of each bucket over a group of its own, all ranks at once.

Trainer rank r's group is [rank r, then every member of the version's group at its rank there],
built on rank 0's store under the epoch's prefix (``BroadcastEnd._rows_group``), so a new member
set or a failed version re-forms them all, as it re-forms the one group of a whole-tensor session.
For each bucket it has rows in, rank r packs them one after another (``RowWriter.pack``: its
*piece* of the bucket, ``RowPlan.piece_bytes`` long), puts the piece's digest behind it and
broadcasts it; two pieces in flight, as two buckets are in a whole-tensor session. No rank
gathers; each sends only its rows, and the device collectives carry them as they carry buckets.

A receiver (``RowsIn``; a sharded relay's heads take the ranks' rows the same way, over pairs)
posts, for each bucket, one broadcast per rank that has rows in it, into buffers of that rank's
own (two deep); then checks each piece against its rank's digest, puts the rows in
their places in the bucket (``unpack_piece``), zeroes the padding and yields the bucket. In host
memory each piece is checked as it is taken; on a device its digest is computed on the device
behind the copy that filled it, and every piece's is compared in one read when the version is
complete, before the receiver commits (as ``digest.Checks`` does for buckets). The bucket's
digest, for the version's, is one of its pieces' digests in rank order: every receiver of a
version arrives at the same value without hashing the bucket again.

Why a group per rank and not one group whose root each rank takes in turn: a collective
group runs its ops one after another, so each rank would wait for the pieces before its own;
with a group each, every trainer host's link is busy at once (measured:
benchmarks/bcast_schedule.py, docs/sharded.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ... import device as devices
from ... import digest
from ...errors import ChecksumError
from ...manifest import RowWriter, gaps, unpack_piece
from ...records import BroadcastGroup
from .. import Deadline, RowsSent
from .ends import BUFFERS, get_checksum, put_checksum
from .groups import Group, settle

if TYPE_CHECKING:
    from .ends import BroadcastEnd


def send_rows(end: BroadcastEnd, version: int, group: BroadcastGroup, rows: RowWriter, deadline: Deadline,
              poll: Callable[[], None]) -> RowsSent:
    """This rank's piece of each bucket it has rows in, over its own group; what it sent.
    Raises what broke the transfer (the caller aborts the version, naming the fault)."""
    kind, me = end.session.digest_kind if end.trailer else None, rows.rows.rank
    pieces = [(b, n) for b in rows.buckets if (n := rows.rows.piece_bytes(b))]
    devices.set_current(end.device)
    g = end._rows_group(group, me, end.ctx.name, 0, deadline, poll) if pieces else None
    sent: list[Any] = []
    sums: list[Any] = []
    for i, (b, n) in enumerate(pieces):
        if i >= BUFFERS:  # the buffer's previous piece has left
            settle(sent[i - BUFFERS], deadline.at, poll, f"rows of bucket {pieces[i - BUFFERS][0]} of version {version}")
        wire = end._wire(i, n)
        end.packed_bytes += rows.pack(b, wire[:n])
        if kind is not None:
            sums.append(put_checksum(wire, n, None, kind))
        sent.append(g.broadcast(wire, deadline.left()))
        end.pending.append(sent[-1])
    for i in range(max(0, len(sent) - BUFFERS), len(sent)):
        settle(sent[i], deadline.at, poll, f"the last rows of version {version}")
    devices.synchronize(end.device)
    end.pending = []
    return RowsSent(rank=me, buckets=[b for b, _ in pieces], sums=digest.as_ints(sums),
                    written=sum(n for _, n in pieces))


class RowsIn:
    """A receiving end's buckets of one sharded version: every rank's piece over that rank's own
    group (``join(r)``), checked and put in place (see the module's docstring). Broadcast's
    receivers, and relay's heads, which then digest the whole bucket into its trailer
    (``whole_digest``) for the members down their chain and their host's followers."""

    def __init__(self, end: Any, version: int, join: Callable[[int], Group], deadline: Deadline,
                 poll: Callable[[], None], whole_digest: bool = False):
        self.end, self.version, self.deadline, self.poll = end, version, deadline, poll
        self.kind = end.session.digest_kind if end.trailer else None
        self.whole_digest = whole_digest
        # each piece was checked against its rank's digest on its way in; a whole digest is of these bytes
        self.checked = "here"
        self.rows = end.ctx.row_plans
        self.groups: dict[int, Group] = {}
        self.buffers: dict[int, list[torch.Tensor]] = {}  # each rank's: its largest piece and a trailer, two deep
        for r, rows in enumerate(self.rows):
            largest = max((rows.piece_bytes(b) for b in rows.pieces), default=0)
            if largest:
                self.groups[r] = join(r)
                self.buffers[r] = [torch.empty(largest + end.trailer, dtype=torch.uint8, device=end.device)
                                   for _ in range(BUFFERS)]
        self.posted: dict[tuple[int, int], Any] = {}
        self.deferred: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # device checks: (rank, b, got, sent)

    def _piece(self, r: int, b: int, n: int) -> torch.Tensor:
        return self.buffers[r][b % BUFFERS][: n + self.end.trailer]

    def post(self, b: int, n: int) -> None:
        """Every rank's piece of bucket ``b`` (``n`` bytes whole) posted into its buffers."""
        for r, g in self.groups.items():
            size = self.rows[r].piece_bytes(b)
            if size:
                self.posted[(r, b)] = g.broadcast(self._piece(r, b, size), self.deadline.left())
                self.end.pending.append(self.posted[(r, b)])

    def take(self, b: int, n: int) -> tuple[torch.Tensor, Any]:
        """Bucket ``b`` whole, in the end's buffer, and its digest (None: digests off): of its
        pieces' digests, or with ``whole_digest`` of its bytes, also written into its trailer."""
        wire = self.end._wire(b, n)
        for start, stop in gaps(self.end.ctx.plan.buckets[b]):
            wire[start:stop].zero_()  # padding: the buffer held another bucket
        sums = []
        for r in self.groups:
            size = self.rows[r].piece_bytes(b)
            if not size:
                continue
            settle(self.posted.pop((r, b)), self.deadline.at, self.poll,
                   f"trainer rank {r}'s rows of bucket {b} of version {self.version}")
            piece = self._piece(r, b, size)
            if self.kind is not None:
                sums.append(self._check(r, b, piece, size))
            unpack_piece(self.rows[r], b, piece, wire)
        if self.whole_digest and self.kind is not None:
            return wire, put_checksum(wire, n, None, self.kind)
        return wire, self._bucket_digest(sums)

    def _check(self, r: int, b: int, piece: torch.Tensor, size: int) -> Any:
        got, sent = digest.compute(self.kind, piece[:size]), get_checksum(piece, size)
        if isinstance(got, torch.Tensor) and got.device.type != "cpu":
            self.deferred.append((r, b, got, sent))  # compared at the end, in one read (finish)
            return sent
        got, sent = digest.as_int(got), digest.as_int(sent)
        if got != sent:
            raise _bad_rows(self.kind, r, b, self.version, got, sent)
        return sent

    def _bucket_digest(self, sums: list[Any]) -> Any:
        if self.kind is None:
            return None
        if sums and isinstance(sums[0], torch.Tensor):
            words = torch.stack([s.reshape(()) for s in sums])
        else:
            words = torch.from_numpy(np.asarray(sums, dtype=np.uint64).view(np.int64))
        return digest.compute(self.kind, words.view(torch.uint8))

    def finish(self) -> None:
        """Compare the pieces' device digests (one read for the version).

        Raises:
            ChecksumError: the first piece, in the order taken, whose bytes differ from what its rank sent.
        """
        if not self.deferred:
            return
        values = digest.as_ints([v for _, _, got, sent in self.deferred for v in (got, sent)])
        for i, (r, b, _, _) in enumerate(self.deferred):
            got, sent = values[2 * i], values[2 * i + 1]
            if got != sent:
                raise _bad_rows(self.kind, r, b, self.version, got, sent)
        self.deferred = []


def _bad_rows(kind: str, r: int, b: int, version: int, got: int, sent: int) -> ChecksumError:
    return ChecksumError(f"bucket {b} of version {version}: trainer rank {r}'s rows arrived with {kind} "
                         f"{got:#018x}, it sent {sent:#018x}")
