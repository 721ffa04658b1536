"""Which storage slot a new version takes (transports that keep versions: shm segments).

A slot stays pinned while a version in it is in flight, is the latest committed one (late
joiners and catch-up read it), or, with ``keep_previous``, is what a live receiver serves (its
rollback). A new version takes the lowest free slot; when all ``max_slots`` are pinned it takes
the lowest slot that does not hold the latest committed version, and the receiver serving
what was there loses its rollback (it still serves the weights it loaded).
"""

from __future__ import annotations

from collections.abc import Iterable

from .versions import VersionTable


def pinned_slots(table: VersionTable, served: Iterable[int], keep_previous: bool) -> set[int]:
    """Slots that must not be overwritten. ``served``: versions live receivers serve."""
    keep = {v.slot for v in table.in_flight()}
    if keep_previous:
        keep |= {table.versions[s].slot for s in served if s in table.versions}
    if table.latest_committed is not None:
        keep.add(table.versions[table.latest_committed].slot)
    return keep


def choose_slot(pinned: set[int], max_slots: int, latest_slot: int | None) -> int:
    slot = next(i for i in range(len(pinned) + 1) if i not in pinned)
    if slot >= max_slots:
        slot = next(i for i in range(max_slots) if i != latest_slot)
    return slot
