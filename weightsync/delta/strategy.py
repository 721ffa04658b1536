"""Internal. How a version is packed and loaded: the full strategies, and delta sync's beside them.

The sender and the receiver walk one version the same way whatever the strategy; what differs
lives here, behind two small interfaces, and so does the choice between them: whether a
session runs delta sync at all (``wanted``: ``delta: auto`` is off on memory-speed transports)
and what the sender's strategy keeps in host memory beside a transport (``host_reserve``).

The two interfaces:

- a packing strategy (sender, rank 0): ``pack`` gives the Packing a transport drives and the
  fields the version's record carries; ``digest`` says whether the transport's digest of the
  buckets is the version's; ``resolved`` learns the version's outcome.
- a loader (receiver), chosen per version by its record (``Loaders.of``): ``holds_base``
  (may it load over what is served), ``begin`` before any byte moves, ``unpack`` per verified
  bucket (the pairs for ``load_weights``), ``digest`` of the whole version, ``rollback`` after
  a failure; ``Loaders.committed`` keeps the shadow's base in step with what is served.

A transport only moves the buckets a Packing hands it and yields them back; what a delta
version's bytes mean stays on this side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from ..digest import version_digest
from ..manifest import BucketPlan, Manifest
from ..packing import Packing, Unpacker
from ..transports.base import VersionRecord
from . import codec
from .policy import FULL
from .receiver import DeltaReceiver
from .sender import DeltaSender

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Pairs = list[tuple[str, torch.Tensor]]

# a view of ``nbytes`` from ``offset`` in a bucket onwards (transports' span), or None
Span = Callable[[int, int, int], "torch.Tensor | None"]


# -- sender ------------------------------------------------------------------------------


class FullPacking:
    """Every version packed whole from the tensors (``delta: off``)."""

    def __init__(self, plan: BucketPlan | None = None, manifest: Manifest | None = None):
        self.plan, self.manifest = plan, manifest

    def pack(self, version: int, named: NamedTensors,
             serving: Callable[[], list[int | None]]) -> tuple[Packing, dict[str, Any]]:
        """(the Packing a transport drives for ``version``, the fields its record carries
        besides the transport's). ``serving()`` asks what each receiver serves."""
        return Packing(self.plan, self.manifest, named), {}

    def digest(self, version: int, transported: str | None) -> str | None:
        """The version's digest as the transport computed it from the buckets it moved, or
        None where the staged record carries the version's own."""
        return transported

    def resolved(self, version: int, committed: bool, seconds: float | None = None) -> None:
        """``version``'s sync() returned (``committed``, after ``seconds``) or raised."""

    def state(self) -> dict[str, Any] | None:
        """What ``WeightSender.delta_state()`` reports."""
        return None


class DeltaPacking(FullPacking):
    """Versions diffed against the host snapshot of the last committed one (``delta: auto``
    or ``on``, delta/sender.py); a version the policy sends whole goes as FullPacking's."""

    def __init__(self, plan: BucketPlan, manifest: Manifest, mode: str):
        super().__init__(plan, manifest)
        self.sender = DeltaSender(plan, manifest, mode)
        self._encoded: set[int] = set()  # recent versions sent as encoded buckets

    def pack(self, version: int, named: NamedTensors,
             serving: Callable[[], list[int | None]]) -> tuple[Packing, dict[str, Any]]:
        held = serving()
        if self.sender.way(held) == FULL:
            self.sender.skip(version)  # auto measured full versions faster: sent as delta: off does
            return super().pack(version, named, serving)
        packing, record, digest = self.sender.prepare(version, named, held)
        self._encoded = {v for v in self._encoded if v > version - 8} | {version}
        # receivers read a delta version by its wire plan from the first record on
        return packing, {"delta": record, "digest": digest}

    def digest(self, version: int, transported: str | None) -> str | None:
        # the transport's is of the encoded buckets; the record has the version's
        return None if version in self._encoded else transported

    def resolved(self, version: int, committed: bool, seconds: float | None = None) -> None:
        self.sender.resolved(version, committed=committed, seconds=seconds)

    def state(self) -> dict[str, Any] | None:
        policy = self.sender.policy
        return {"base": self.sender.base, **({"auto": policy.describe()} if policy is not None else {})}


# transports that move bytes at memory speed: the host work of a delta (diff at the trainer,
# apply and hash at each receiver) costs more than the bytes it saves there (measured with
# benchmarks/delta_probe.py: shm 0.72 s full vs 2.7 s delta for 1.2 GB at 1 % changed)
MEMORY_SPEED = frozenset({"shm", "ipc"})


def wanted(mode: str, transport: str) -> bool:
    """Whether a session runs delta sync: ``on`` always, ``auto`` except on memory-speed
    transports (there it is ``off``: no snapshot, no shadow), ``off`` never."""
    return mode == "on" or (mode == "auto" and transport not in MEMORY_SPEED)


def host_reserve(mode: str, transport: str, plan: BucketPlan) -> int:
    """Host bytes the sender keeps on its node beside ``transport``'s buffers for config
    ``delta: mode``: the snapshot where the session runs delta sync (delta/sender.py), else 0."""
    return codec.snapshot_bytes(plan.bucket_count, plan.bucket_bytes) if wanted(mode, transport) else 0


def packing_for(mode: str, transport: str, sends: bool, plan: BucketPlan, manifest: Manifest) -> FullPacking:
    """The sender's packing strategy for config ``delta: mode`` on ``transport``; only the
    rank that sends keeps a snapshot."""
    if sends and wanted(mode, transport):
        return DeltaPacking(plan, manifest, mode)
    return FullPacking(plan, manifest)


# -- receiver ----------------------------------------------------------------------------


class LoaderTransport(Protocol):
    """What a loader asks of the receiver's transport (transports/base.ReceiverTransport has it)."""

    def span(self, version: int, info: VersionRecord) -> Span | None:
        """A view over a whole version where the transport holds one (None: reassemble)."""

    def buffers_generation(self) -> int:
        """Changes whenever buffers it yielded before went (views of them must go too)."""


@dataclasses.dataclass
class Engine:
    """What a loader may do to the model and the transport when a version fails."""

    load: Callable[[Pairs], Any]  # load_weights
    finish: Callable[[], None]  # post_load, then reset_cache (raises if the engine did not reset)
    # receive an earlier version again through the transport and load it whole, hooks included
    replay: Callable[[int, VersionRecord], None]
    can_replay: Callable[[int, VersionRecord], bool]


class FullLoader:
    """Unpacks the buckets as they arrive (views of the transport's buffers, or of its whole
    version where the transport has one) for ``load_weights``."""

    def __init__(self, unpacker: Unpacker):
        self.unpacker = unpacker
        self._span: Span | None = None
        self._generation = 0  # of the transport's buffers the unpacker's views show

    def holds_base(self, info: VersionRecord) -> bool:
        """Whether this receiver can load the version over what it serves."""
        return True

    def begin(self, version: int, info: VersionRecord, transport: LoaderTransport) -> None:
        """Before any byte moves; raises to refuse the version."""
        self._span = transport.span(version, info)
        if transport.buffers_generation() != self._generation:
            self._generation = transport.buffers_generation()
            self.unpacker.forget()  # their buffers went: views of them would keep them mapped

    def unpack(self, version: int, info: VersionRecord, b: int, buf: torch.Tensor) -> Pairs:
        """Bucket ``b``, verified as received: the pairs to load now."""
        return self.unpacker.unpack(b, buf, self._span)

    def digest(self, kind: str | None, verified: list[int]) -> str | None:
        """The whole version's digest, from the bucket digests ``verified`` (None where not
        every bucket was): equal to the sender's when both hold the same bytes."""
        return version_digest(kind, verified)

    def rollback(self, prev: int | None, prev_info: VersionRecord | None, touched: bool,
                 serving: int | None, engine: Engine) -> tuple[str, int | None]:
        """After the version being loaded failed (``touched``: a bucket of it reached the
        model): (a reason suffix, the version served now); ``prev`` / ``prev_info``: the
        version served before it, ``serving``: what the receiver serves now."""
        if not touched:
            return "", serving
        # a delta version's bytes at the transport are encoded buckets, not the version
        if prev is None or prev_info is None or prev_info.delta is not None or not engine.can_replay(prev, prev_info):
            return f"; serves no version until the next sync (previous version {prev} is not at hand)", serving
        try:
            engine.replay(prev, prev_info)
        except Exception as exc:  # the engine's own hooks raise what they raise; the version still fails
            return f"; rollback to version {prev} failed too ({type(exc).__name__}: {exc}); serves no version", serving
        return f"; rolled back to version {prev}", prev


class DeltaLoader:
    """Rebuilds each bucket in the host shadow of the served version, verifies it against the
    sender's digest of the full bucket, then loads the tensors it changed (delta/receiver.py).
    The shadow is allocated at the first delta version."""

    def __init__(self, unpacker: Unpacker, name: str):
        self.unpacker, self.name = unpacker, name
        self.shadow: DeltaReceiver | None = None
        self._rebuilt: list[int] = []  # digests of the buckets rebuilt in the shadow

    def holds_base(self, info: VersionRecord) -> bool:
        base = info.delta.base if info.delta is not None else None
        return base is None or (self.shadow is not None and self.shadow.version == base)

    def begin(self, version: int, info: VersionRecord, transport: LoaderTransport) -> None:
        if self.shadow is None:
            self.shadow = DeltaReceiver(self.unpacker.plan, self.unpacker.manifest, self.name)
        self._rebuilt = []
        self.shadow.begin(version, info.delta)

    def unpack(self, version: int, info: VersionRecord, b: int, buf: torch.Tensor) -> Pairs:
        pairs, got = self.shadow.apply(version, info.delta, b, buf)
        self._rebuilt.append(got)
        return pairs

    def digest(self, kind: str | None, verified: list[int]) -> str | None:
        return version_digest("xxh3", self._rebuilt)

    def rollback(self, prev: int | None, prev_info: VersionRecord | None, touched: bool,
                 serving: int | None, engine: Engine) -> tuple[str, int | None]:
        if self.shadow is None:
            return "", serving  # refused before a shadow existed
        shadow = self.shadow
        try:
            why = shadow.failed(prev, engine.load if touched else None)
            if touched and shadow.version is not None:
                engine.finish()
        except Exception as exc:  # the engine's own hooks raise what they raise; the version still fails
            shadow.version = None
            return f"; rollback to version {prev} failed too ({type(exc).__name__}: {exc}); serves no version", None
        if touched or shadow.diverged:
            # a diverged shadow is no base even when nothing of the version reached the model:
            # serving prev without it, this receiver would be sent deltas it must refuse
            return why, shadow.version
        return "", serving

    def committed(self, version: int | None) -> None:
        if self.shadow is not None:
            self.shadow.committed(version)


class Loaders:
    """A receiver's loaders: a version whose record carries delta encodings loads through the
    shadow, any other whole from the transport's buffers."""

    def __init__(self, unpacker: Unpacker, name: str):
        self.full = FullLoader(unpacker)
        self.delta = DeltaLoader(unpacker, name)

    def of(self, info: VersionRecord) -> FullLoader | DeltaLoader:
        return self.full if info.delta is None else self.delta

    def holds_base(self, info: VersionRecord) -> bool:
        """False for a delta against a version this receiver's shadow does not hold."""
        return self.of(info).holds_base(info)

    def committed(self, version: int, info: VersionRecord) -> None:
        # a version loaded whole leaves the shadow behind: the next delta is refused
        self.delta.committed(version if info.delta is not None else None)
