"""Who is in the session: the coordinator's registry of parties and their liveness. Pure: no
Ray, no I/O; callers pass ``now`` (time.monotonic())."""

from __future__ import annotations

import dataclasses

from ..errors import ProtocolError, SessionLost
from .ops import BroadcastGroup, Device, PartyStatus
from .versions import Version


@dataclasses.dataclass
class PartyRecord:
    """What the coordinator knows of one registered party."""

    pid: int  # party id within the session
    name: str
    role: str  # "sender" | "receiver"
    rank: int
    host: str
    os_pid: int
    node_id: str
    device: Device | None
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
    # receivers: an ahead thread waits for versions (config receive_ahead), with its shadow ready
    ahead: bool = False

    @property
    def present(self) -> bool:
        return self.alive and not self.left

    @property
    def rejected(self) -> bool:
        return self.verdict not in (None, "")

    @property
    def label(self) -> str:
        return f"{self.role} '{self.name}' (rank {self.rank}, pid {self.os_pid} on {self.host})"

    def public(self, now: float) -> PartyStatus:
        return PartyStatus(
            name=self.name, role=self.role, rank=self.rank, host=self.host, node_id=self.node_id,
            pid=self.os_pid, alive=self.present, left=self.left, serving=self.serving,
            applying=self.applying, silent_s=round(now - self.last_seen, 3),
            manifest="pending" if self.verdict is None else ("accepted" if self.verdict == "" else "rejected"),
            why=self.why, ahead=self.ahead,
        )


class Parties:
    def __init__(self, first_pid: int):
        self.records: dict[int, PartyRecord] = {}
        self._next_pid = first_pid

    def add(self, role: str, name: str, rank: int, host: str, os_pid: int, node_id: str,
            device: Device | None, now: float) -> tuple[PartyRecord, list[PartyRecord]]:
        """Register a party; returns it and the parties of the same name it replaced (the
        newest registration wins: a restarted worker takes its name back at once instead of
        waiting for its dead predecessor's heartbeat to time out)."""
        if role not in ("sender", "receiver"):
            raise ProtocolError(f"role must be 'sender' or 'receiver', got {role!r}")
        replaced = [p for p in self.records.values() if p.name == name and not p.left]
        for other in replaced:
            other.left, other.why = True, f"replaced by a new registration (pid {os_pid})"
        record = PartyRecord(self._next_pid, name, role, int(rank), host, int(os_pid), node_id, device, now)
        self.records[record.pid] = record
        self._next_pid += 1
        return record, replaced

    def touch(self, pid: int, now: float, seen: bool = True) -> PartyRecord:
        """The party behind ``pid`` made a call: it is alive (a stalled party came back).
        ``seen=False``: a re-check inside a long wait; the call arrived once, and a party
        killed while it waits (a sender in wait_outcome) must still go silent."""
        p = self.records.get(pid)
        if p is None:
            raise SessionLost(f"party {pid} is not registered in this session (coordinator restarted?)")
        if p.left:
            raise ProtocolError(f"{p.label} is no longer in the session: {p.why}")
        if not seen:
            return p
        p.last_seen = now
        if not p.alive:
            p.alive, p.why, p.reported_dead = True, "", False
        return p

    def leave(self, pid: int) -> PartyRecord | None:
        p = self.records.get(pid)
        if p is None or p.left:
            return None
        p.left, p.why = True, "left the session"
        return p

    def silent(self, now: float, limit: float) -> list[PartyRecord]:
        """Mark parties silent for more than ``limit`` seconds dead; returns them."""
        found = []
        for p in self.records.values():
            if p.present and now - p.last_seen > limit:
                p.alive = False
                p.why = f"silent for {now - p.last_seen:.1f}s (dead or stalled; heartbeat_timeout_s={limit})"
                found.append(p)
        return found

    def named(self, role: str, name: str) -> PartyRecord | None:
        found = [p for p in self.records.values() if p.role == role and p.name == name and not p.left]
        return found[-1] if found else None

    def receivers(self) -> list[PartyRecord]:
        """Live receivers, by rank."""
        return sorted((p for p in self.records.values() if p.role == "receiver" and p.present), key=lambda p: p.rank)

    def at_barrier(self) -> list[PartyRecord]:
        """Receivers a version's barrier offers itself to: all that are in the session, except
        dead ones already named in an earlier version."""
        return [p for p in self.records.values()
                if p.role == "receiver" and not p.left and not (p.reported_dead and not p.alive)]

    def sender0(self) -> PartyRecord | None:
        found = [p for p in self.records.values() if p.role == "sender" and p.rank == 0]
        return found[-1] if found else None

    def lost_members(self, v: Version, group: BroadcastGroup, caller: str) -> list[str]:
        """Members of broadcast ``group`` (other than ``caller``) that died, left, or failed ``v``."""
        lost = []
        for role, name in [("sender", group.sender)] + [("receiver", n) for n in group.members]:
            if name == caller:
                continue
            p = self.named(role, name)
            if p is None or p.pid != group.pids.get(name, p.pid):
                lost.append(f"{role} '{name}' left the session")
            elif not p.alive:
                lost.append(f"{p.label} {p.why}")
            elif name in v.failed and not v.failed[name].startswith("version aborted"):
                lost.append(v.failed[name])
        return lost

    def public(self, now: float) -> list[PartyStatus]:
        return [p.public(now) for p in sorted(self.records.values(), key=lambda p: (p.role, p.rank, p.pid))
                if not p.left]
