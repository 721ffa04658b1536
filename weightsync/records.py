"""Internal. Everything that crosses a process boundary: the msgpack codec, its strict decoder and
every record of the control plane, the requests a party sends the coordinator and the replies it
gets, and the bases of the records a transport publishes for its receivers (each transport's own
subclasses live beside it and decode here too).

A record is a dataclass decoded by its fields and type hints, so it declares its shape once and
a field missing, unknown or of the wrong type is a ProtocolError naming the record and the
field, at the first message, not a KeyError deep in a transfer.

Msgpack only, so no message that crossed a process boundary is ever unpickled: Ray or the
coordinator's channel still carry the bytes, but what they decode to is plain data (dicts,
lists, str, int, float, bytes), never code.

The control plane: a request names its reply type (``reply``); the coordinator serves each
request type with exactly one handler (``@handles(Request)`` in coordinator/actor.py), so the
call graph is what a reader and a type checker see. On the wire a request is the msgpack map
``{"op": <type name>, "token": <session token>, "args": <fields>}`` and a reply
``{"ok": true, "type": <type name>, "result": <fields>}`` (a failed call: ``{"ok": false}`` with
the fields of :class:`Failure`). A map the coordinator stores and forwards unread (a transport's
records, parsed where they arrive; the config, checked by ``SyncConfig.from_mapping``) is a
:data:`WireMap`: on arrival it is checked to be plain msgpack data, str keys all the way down,
and nothing more.
"""


from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
import typing
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import msgpack
from typing_extensions import TypeAliasType  # typing's own from Python 3.12

from .errors import ProtocolError

MAX_MESSAGE_BYTES = 64 << 20
# the control channel's frame: this many bytes of big-endian length, then the msgpack payload
FRAME_HEADER = 4
# a connection to the coordinator's control channel opens with one small frame that proves the
# session token (HELLO followed by the token), before any frame larger than HELLO_MAX is read
HELLO = b"weightsync-channel/1\0"
HELLO_MAX = 256

# -- wire values: plain msgpack data ----------------------------------------------------------
#
# What a field holds when the coordinator stores and forwards it unread (a transport's record in
# its wire form, merged in parts; the config): plain data, maps with str keys all the way down.
# ``parse`` checks a Wire field on arrival (``wire_value``), so such a map cannot smuggle an
# object, a non-str key or a nesting that has no end past the boundary.
# A named alias (TypeAliasType), not a plain union: typing.get_type_hints would unroll a plain
# recursive union into copies ``parse`` could not tell from any other union.
Wire = TypeAliasType("Wire", None | bool | int | float | str | bytes | list["Wire"] | dict[str, "Wire"])
WireMap = dict[str, Wire]
MAX_WIRE_DEPTH = 32  # far below msgpack's and Python's stacks; records nest a few levels


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not accepted on the control plane")


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode(payload: Any) -> Any:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"control message must be msgpack bytes, got {type(payload).__name__}")
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"control message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return msgpack.unpackb(
            payload, raw=False, strict_map_key=True, ext_hook=_refuse_ext
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types for junk (e.g. a pickle stream)
        raise ProtocolError(f"control message is not valid msgpack: {type(exc).__name__}: {exc}") from None


# -- typed records: one strict decoder, driven by a dataclass's fields and type hints ---------


def to_wire(record: Any) -> WireMap:
    """``record``'s fields as plain msgpack-able data (nested records as their own maps)."""
    return {f.name: _out(getattr(record, f.name)) for f in dataclasses.fields(record)}


def _out(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value.to_wire() if hasattr(value, "to_wire") else to_wire(value)
    if isinstance(value, (list, tuple)):
        return [_out(v) for v in value]
    if isinstance(value, dict):
        return {k: _out(v) for k, v in value.items()}
    return value


R = TypeVar("R")


def from_wire(cls: type[R], wire: Any, what: str, foreign: frozenset[str] = frozenset()) -> R:
    """The ``cls`` record of ``wire``; ``what`` names it in errors; ``foreign``: keys others
    than the writer add to the map, which the record ignores.

    Raises:
        ProtocolError: ``wire`` is not a map, or a field is missing, unknown or of the wrong
            type (or the record's own checks refuse a value); names ``what`` and the field.
    """
    if not isinstance(wire, Mapping):
        raise ProtocolError(f"{what} arrived as {type(wire).__name__}, not a map")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in wire if k not in fields and k not in foreign)
    if unknown:
        raise ProtocolError(f"{what} has unknown field {unknown[0]!r} (the two ends run different "
                            f"weightsync versions?)")
    hints = hints_of(cls)
    args = {}
    for name, f in fields.items():
        if name in wire:
            args[name] = parse(hints[name], wire[name], f"{what} field {name!r}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{what} lacks field {name!r}")
    try:
        return cls(**args)
    except (TypeError, ValueError) as exc:  # a record's __post_init__ checks of a value
        raise ProtocolError(f"{what}: {exc}") from None


@functools.cache
def hints_of(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse(tp: Any, value: Any, where: str) -> Any:
    """``value`` checked against the annotation ``tp``; raises ProtocolError naming ``where``."""
    if tp is Wire:
        return wire_value(value, where)
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        why = []
        for option in typing.get_args(tp):
            try:
                return parse(option, value, where)
            except ProtocolError as exc:
                why.append(str(exc))
        names = " / ".join(getattr(t, "__name__", str(t)) for t in typing.get_args(tp))
        raise ProtocolError(f"{where} is {type(value).__name__}, not {names}"
                            + (f" ({'; '.join(why)})" if isinstance(value, Mapping) else ""))
    if tp is type(None):
        if value is None:
            return None
    elif origin is list:
        if isinstance(value, (list, tuple)):
            (item,) = typing.get_args(tp) or (Any,)
            return [parse(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    elif origin is dict or tp is dict:
        if isinstance(value, Mapping):
            _str_keys(value, where)
            key, item = typing.get_args(tp) or (str, Any)
            return {k: parse(item, v, f"{where}[{k!r}]") for k, v in value.items()}
    elif tp is Any:
        return value
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, Mapping):
            own = getattr(tp, "from_wire", None)  # a record that names itself its own way
            return own(value) if own is not None else from_wire(tp, value, tp.__name__)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    name = getattr(tp, "__name__", str(tp))
    raise ProtocolError(f"{where} is {type(value).__name__}, not {name}")


def _str_keys(value: Mapping, where: str) -> None:
    for k in value:
        if not isinstance(k, str):
            raise ProtocolError(f"{where} has a key of type {type(k).__name__} ({k!r:.40}), not str")


def wire_value(value: Any, where: str, depth: int = 0) -> Wire:
    """``value`` checked to be :data:`Wire` (plain msgpack data, maps with str keys); raises
    ProtocolError naming ``where`` and the path to the first value that is not."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if depth >= MAX_WIRE_DEPTH:
        raise ProtocolError(f"{where} nests deeper than {MAX_WIRE_DEPTH} levels")
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            wire_value(v, f"{where}[{i}]", depth + 1)
        return value
    if isinstance(value, Mapping):
        _str_keys(value, where)
        for k, v in value.items():
            wire_value(v, f"{where}[{k!r}]", depth + 1)
        return value
    raise ProtocolError(f"{where} is {type(value).__name__}, not a wire value "
                        f"(None, bool, int, float, str, bytes, a list or a map of them)")


# -- the states of a version, as every party names them ---------------------------------------------


class State(str, enum.Enum):
    """Where a version is (coordinator/actor.py: VersionTable moves it); its value is what the wire carries."""

    STAGING = "STAGING"
    STAGED = "STAGED"
    TRANSFERRING = "TRANSFERRING"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"

    def __str__(self) -> str:
        return self.value



# -- the records a transport publishes ----------------------------------------------------------
#
# A transport's sender publishes a session record once (rendezvous, digest kind) and a version
# record per version (where the bytes are); the coordinator stores and forwards their wire forms
# without reading them and each receiver parses them back where they arrive. A plugin transport
# brings its own subclasses and names them in its declaration (weightsync.transports.Transport).

DIGEST_KINDS = (None, "xxh3", "torch")
# how a delta version carries each bucket (delta/codec.py encodes them): nothing, the changed
# words, or the whole bucket
SKIP, SPARSE, FULL = "skip", "sparse", "full"
ENCODINGS = (SKIP, SPARSE, FULL)
RecordT = TypeVar("RecordT", bound="Record")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """A typed record with a strict wire form; subclasses name their ``transport``."""

    transport: typing.ClassVar[str] = "transport"
    # keys that others than the sender add to the wire form and the record ignores (see
    # VersionRecord); never a field
    foreign: typing.ClassVar[frozenset[str]] = frozenset()

    def to_wire(self) -> WireMap:
        """Plain data (dicts, lists, str, int, float, bool, bytes, None) for the control plane."""
        return to_wire(self)

    @classmethod
    def from_wire(cls: type[RecordT], wire: Any) -> RecordT:
        """The record of ``wire`` (a ``to_wire()`` form that crossed the control plane).

        Raises:
            ProtocolError: a field is missing, unknown or of the wrong type; names the
                transport and the field.
        """
        return from_wire(cls, wire, f"{cls.transport}: {cls.__name__}", cls.foreign)

    def _check(self, name: str, ok: bool, want: str) -> None:
        if not ok:
            raise ValueError(f"field {name!r} is {getattr(self, name)!r}, not {want}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SessionRecord(Record):
    """Published once with the session: what a transport's receivers need, and what the sender
    and the coordinator must know of how it runs."""

    digest_kind: str | None  # of the bucket digests (weightsync.digest), None: off
    # a committed version stays readable after the sender moved on or died (late joiners catch
    # up from it, a receiver rolls back to it)
    keeps_versions: bool = False
    # versions can reach the receivers before their barrier (receive_ahead)
    ahead: bool = False
    # how the transport runs here and why (shm: whole versions or a bounded stream), added to
    # the transport's reason that status() shows
    why: str = ""

    def __post_init__(self) -> None:
        self._check("digest_kind", self.digest_kind in DIGEST_KINDS, " / ".join(map(str, DIGEST_KINDS)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeltaRecord(Record):
    """A delta version's wire plan (delta/codec.py): per bucket its encoding and the bytes
    that move, and the digest of the whole bucket as the sender packed it, which the bucket a
    receiver rebuilds must match. ``base``: the committed version the deltas apply to (None:
    every bucket is full; receivers keep the version as the base of the next delta)."""

    transport: typing.ClassVar[str] = "delta"
    base: int | None
    kinds: list[str]
    lengths: list[int]
    digests: list[int]  # xxh3 per bucket, unsigned 64-bit

    def __post_init__(self) -> None:
        n = len(self.kinds)
        self._check("lengths", len(self.lengths) == n and all(x >= 0 for x in self.lengths),
                    f"{n} lengths >= 0")
        self._check("digests", len(self.digests) == n and all(0 <= d < 1 << 64 for d in self.digests),
                    f"{n} unsigned 64-bit digests")
        self._check("kinds", all(k in ENCODINGS for k in self.kinds), " / ".join(ENCODINGS) + " per bucket")
        self._check("kinds", self.base is not None or all(k == FULL for k in self.kinds), "full without a base")
        self._check("lengths", all(x == 0 for k, x in zip(self.kinds, self.lengths) if k == SKIP),
                    "0 for a skipped bucket")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VersionRecord(Record):
    """Published per version (early by a transport that announces, whole once staged); the
    coordinator merges the parts, so a field a later part brings has a default."""

    # the coordinator notes a broadcast version's group here for metrics (coordinator/actor.py, bcast_form)
    foreign: typing.ClassVar[frozenset[str]] = frozenset({"group"})
    digest: str | None = None  # of the whole version (digest.version_digest), once packed
    # a delta version's wire plan (the sender's delta: auto / on); None: the session plan
    delta: DeltaRecord | None = None

    def moves(self, plan: Any) -> Any:
        """The bucket lengths this version moves over the session ``plan`` (a manifest.BucketPlan),
        bucket for bucket: the plan's own, or the encoded lengths its delta record names, so a
        transport sizes what it reads without knowing what the bytes mean."""
        return plan if self.delta is None else plan.with_lengths(self.delta.lengths)

# -- the control plane's records --------------------------------------------------------------

M = TypeVar("M", bound="Message")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Message:
    """A record of the control plane: a strict wire form, decoded by its fields."""

    def to_wire(self) -> WireMap:
        return to_wire(self)

    @classmethod
    def from_wire(cls: type[M], wire: Any) -> M:
        return from_wire(cls, wire, f"control: {cls.__name__}")

    def as_dict(self) -> WireMap:
        """The record as a plain map (what ``json.dumps`` takes)."""
        return self.to_wire()


class DictReads:
    """Dict-style reads (``record["key"]``, ``.get``, ``in``, ``.keys()``, ...) of a record the
    public API returned as a plain map before: they read the record's ``as_dict()`` and warn
    once per call site (DeprecationWarning), for one release: read the attributes, or
    ``as_dict()`` where a plain map is wanted."""

    def _legacy(self, what: str) -> WireMap:
        warnings.warn(f"reading a weightsync record as a dict is deprecated ({type(self).__name__}{what}): read its "
                      f"attributes, or .as_dict() for a plain map", DeprecationWarning, stacklevel=3)
        return self.as_dict()  # type: ignore[attr-defined]  # every user is a Message

    def __getitem__(self, key: str) -> Wire:
        return self._legacy(f"[{key!r}]")[key]

    def get(self, key: str, default: Wire = None) -> Wire:
        return self._legacy(f".get({key!r})").get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._legacy(f": {key!r} in")

    def __iter__(self) -> Iterator[str]:
        return iter(self._legacy(": iterating the keys"))

    def keys(self) -> list[str]:
        return list(self._legacy(".keys()"))

    def values(self) -> list[Wire]:
        return list(self._legacy(".values()").values())

    def items(self) -> list[tuple[str, Wire]]:
        return list(self._legacy(".items()").items())


# -- replies --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Done(Message):
    """The reply of an operation that only has to have happened."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Failure(Message):
    """The reply of any operation that failed: the coordinator's error, raised again by the
    client as its own class (``kind``); a SyncFailed brings who failed and who committed."""

    kind: str
    error: str
    version: int | None = None
    failed: dict[str, str] | None = None
    committed: list[str] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device(Message):
    """Where a party runs (weightsync.device.describe)."""

    type: str
    index: int | None = None
    physical: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class IpcSupport(Message):
    """Whether a sender can share device buckets by handle (transports/ipc/support.py: Capability)."""

    ok: bool
    reason: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement(Message):
    """Where a party runs, as the transport choice reads it (transports.choose). ``ipc``: whether
    the sender can share device buckets by handle (transports/ipc/support.py; the choice probes it
    where a rule asks and this is None)."""

    name: str = ""
    rank: int = 0
    host: str = ""
    node_id: str = ""
    device: Device | None = None
    serving: int | None = None  # a delta sender sends full unless every receiver holds its base
    ipc: IpcSupport | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placements(Message):
    receivers: list[Placement]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Registered(DictReads, Message):
    """A party's place in the session (``Coordinator.register()`` returns it)."""

    party: int
    session: str
    config: WireMap  # SyncConfig.to_dict()


@dataclasses.dataclass(frozen=True, kw_only=True)
class SessionInfo(Message):
    manifest: list[Wire]  # Manifest.to_wire()
    digest: str
    transport: str
    info: WireMap  # Publication.info, as published
    session: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slot(Message):
    slot: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Participants(Message):
    participants: list[str]
    failed: list[str] = dataclasses.field(default_factory=list)  # of them, those failed already


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target(Message):
    """Which version a receiver should read next and where its bytes are (None: nothing yet)."""

    version: int | None
    state: str | None = None
    slot: int | None = None
    # the wire form of the version's record (records.VersionRecord), parts merged by the coordinator
    info: WireMap = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VersionState(Message):
    state: str
    reason: str
    info: WireMap


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReceiverMetrics(DictReads, Message):
    """What one version cost one receiver, as it measured it (``WeightReceiver.last_metrics``;
    each receiver's in ``Metrics.receivers``). ``as_dict()`` gives it as a plain map.

    Attributes:
        wait_s: Seconds waiting for buckets to arrive.
        verify_s: Seconds verifying bucket digests.
        load_s: Seconds in ``load_weights``.
        post_load_s: Seconds in the post-load hook.
        reset_cache_s: Seconds in the engine's cache reset.
        total_s: Seconds the whole load took.
        bytes: Bytes received (the encoded buckets of a delta version).
        peer_verified_buckets: Buckets another receiver on the node verified for this one.
        gbps: ``bytes`` over ``total_s``, in GB/s.
        received_ahead: The version came in before its barrier (``receive_ahead``).
        digest: The whole version's digest, from the bucket digests verified (None with
            digests off, or where not every bucket was verified).
        calls: Coordinator calls the receiver made for the version, its report included
            (0 in ``Metrics.receivers``: the report went before they were counted).
    """

    wait_s: float
    verify_s: float
    load_s: float
    post_load_s: float
    reset_cache_s: float
    total_s: float
    bytes: int
    peer_verified_buckets: int
    gbps: float
    received_ahead: bool
    digest: str | None
    calls: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Metrics(DictReads, Message):
    """One version as the coordinator records it (``Coordinator.metrics(v)``, each of
    ``Status.versions``, ``SyncResult.metrics``). ``as_dict()`` gives it as a plain map.

    Attributes:
        version: The version.
        state: STAGING, STAGED, TRANSFERRING, COMMITTED or ABORTED.
        slot: The storage slot it took (shm's segment).
        reason: Why it was aborted ("" otherwise).
        participants: The receivers that take part, fixed at the barrier.
        committed: Those that committed it.
        failed: Receiver (or "sender") -> why it failed.
        phases_s: Seconds by phase (``stage_s``).
        receivers: Each receiver's own measurements, as it reported them.
        bytes: Payload bytes of a version.
        info: The transport's record of the version, as published (where its bytes are).
        digest: The sender's whole-version digest (docs/digest.md); None with digests off.
        receiver_digests: Each reporting receiver's whole-version digest, equal to
            ``digest`` when it holds the same bytes.
        barrier_s: Seconds from the barrier to the outcome, once finished.
        gbps: Payload GB/s over staging and barrier, once finished.
    """

    version: int
    state: str
    slot: int
    reason: str
    participants: list[str]
    committed: list[str]
    failed: dict[str, str]
    phases_s: dict[str, float]
    receivers: dict[str, ReceiverMetrics]
    bytes: int
    info: WireMap
    digest: str | None
    receiver_digests: dict[str, str | None]
    barrier_s: float | None = None
    gbps: float | None = None

    def as_dict(self) -> WireMap:
        out = self.to_wire()
        if self.barrier_s is None:  # unfinished versions never showed these keys
            del out["barrier_s"], out["gbps"]
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lag(Message):
    lag: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartyStatus(DictReads, Message):
    """One party as the coordinator sees it (``Status.parties``).

    Attributes:
        name: The party's name.
        role: "sender" or "receiver".
        rank: Its rank.
        host: Its host address.
        node_id: Its Ray node id.
        pid: Its process id.
        alive: It is in the session and its heartbeat comes.
        left: It left (or was replaced by a new registration of its name).
        serving: Receivers: the version whose weights they hold whole.
        applying: Receivers: the version they are loading.
        silent_s: Seconds since it was last heard.
        manifest: Receivers' verdict on the manifest: pending, accepted or rejected.
        why: Why it is down or rejected ("" otherwise).
        ahead: Receivers: an ahead thread takes versions before their barrier.
    """

    name: str
    role: str
    rank: int
    host: str
    node_id: str
    pid: int
    alive: bool
    left: bool
    serving: int | None
    applying: int | None
    silent_s: float
    manifest: str
    why: str
    ahead: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class Status(DictReads, Message):
    """The session as the coordinator sees it (``Coordinator.status()``; ``format_status()``
    prints it). ``as_dict()`` gives it as a plain map, e.g. for JSON.

    Attributes:
        session: The session id (a restarted coordinator has a new one).
        transport: The transport sender rank 0 chose (None before its first version).
        transport_reason: Why that transport (and its mode).
        pipelined: The transport reads a version's tensors in ``stage()``: staging early
            frees the barrier.
        group: The broadcast session's backend and communicator, and why.
        manifest_tensors: Tensors in the manifest.
        payload_bytes: Payload bytes of a version.
        latest_committed: The newest committed version, or None.
        parties: Every party in the session.
        versions: The last 20 versions.
        resources: Segments and handles open, by kind (leaks show here).
        calls: Control-plane calls served, by op (docs/benchmarks.md).
        via: Calls served by the way they came: "ray" or "socket" (the control channel).
        config: The coordinator's configuration (``SyncConfig.to_dict()``).
    """

    session: str
    transport: str | None
    transport_reason: str
    pipelined: bool
    group: dict[str, str]
    manifest_tensors: int
    payload_bytes: int
    latest_committed: int | None
    parties: list[PartyStatus]
    versions: list[Metrics]
    resources: dict[str, int]
    calls: dict[str, int]
    via: dict[str, int]
    config: WireMap

    def as_dict(self) -> WireMap:
        out = self.to_wire()
        out["versions"] = [v.as_dict() for v in self.versions]
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class BroadcastGroup(Message):
    """The collective group of a broadcast version (coordinator/actor.py, BroadcastGroups): the
    sender at group rank 0, ``members`` after it; ``rank``: the asking receiver's. A relay
    version's members are one receiver per receiving host, in the order the version is relayed
    (the sender sends to the first, each passes it to the next); ``followers`` maps every other
    receiver to the member of its host it reads the version from (the sender, on the sender's
    host); a follower's ``rank`` is None."""

    epoch: int
    nonce: str  # a restarted coordinator counts epochs from 1 again: this keeps names unique
    sender: str
    members: list[str]
    pids: dict[str, int]  # a re-registered party is a new member
    size: int
    rank: int | None = None
    followers: dict[str, str] = dataclasses.field(default_factory=dict)
    # a sharded relay's members that take every trainer rank's rows themselves (the first
    # ``heads``); member i after them takes its buckets from member i - heads: ``heads`` chains
    heads: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Formed(Message):
    """``group`` None: formed ahead was refused (some live receiver is not ready to take the
    version before its barrier); the version goes at the barrier."""

    group: BroadcastGroup | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupCheck(Message):
    aborted: str | None  # the abort reason, None while the version is on
    lost: list[str]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reason(Message):
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChannelAddress(Message):
    """Where the coordinator serves its control channel (coordinator/actor.py)."""

    host: str
    port: int


# -- requests -------------------------------------------------------------------------------


# every request type by its wire name (filled as each is declared); the coordinator refuses any other
REQUESTS: dict[str, type[Request]] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request(Message):
    """A call to the coordinator; ``reply``: the type of its answer. ``op`` (by default the
    type's name in snake case) counts the call in ``Status.calls``."""

    reply: ClassVar[type[Message]] = Done
    op: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "op" not in cls.__dict__:
            cls.op = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
        REQUESTS[cls.__name__] = cls


@dataclasses.dataclass(frozen=True, kw_only=True)
class Served(Message):
    """Where the bytes of the version a re-registering receiver serves are: slot and record."""

    slot: int | None = 0
    info: WireMap = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Register(Request):
    """Join the session. A party re-registering after a coordinator restart brings what the
    coordinator lost: the newest version it staged (senders) or the version it serves and
    where its bytes are (receivers)."""

    reply: ClassVar[type[Message]] = Registered
    role: str
    name: str
    rank: int
    host: str
    os_pid: int
    node_id: str = ""
    device: Device | None = None
    last_version: int | None = None
    serving: int | None = None
    served: Served | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Heartbeat(Request):
    party: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Leave(Request):
    party: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resource(Request):
    """Open (+1) / close (-1) of a segment or handle, so leaks show in status()."""

    party: int
    kind: str
    delta: int


@dataclasses.dataclass(frozen=True)
class Publication(Message):
    """What sender rank 0 fixes for the session: layout and transport."""

    manifest: list[Wire]  # Manifest.to_wire()
    digest: str
    payload_bytes: int
    transport: str
    reason: str  # why this transport was chosen
    # the wire form of the transport's session record (records.SessionRecord): the coordinator
    # stores and forwards it unread; the receivers' transports parse it
    info: WireMap
    pipelined: bool = False  # see SenderTransport.pipelined
    keeps_versions: bool = False  # see SenderTransport.keeps_versions
    senders: int = 1  # trainer ranks that write each version (a sharded session: every rank its rows)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Publish(Request):
    party: int
    publication: Publication


@dataclasses.dataclass(frozen=True, kw_only=True)
class Session(Request):
    """Wait for the sender's manifest and transport choice."""

    reply: ClassVar[type[Message]] = SessionInfo
    party: int
    timeout: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Receivers(Request):
    """Wait until ``count`` receivers are registered and alive; they come by rank."""

    reply: ClassVar[type[Message]] = Placements
    party: int
    count: int
    timeout: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict(Request):
    """The manifest check's outcome, before any byte moves."""

    party: int
    accepted: bool
    why: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BeginStage(Request):
    """Open ``version`` (sender rank 0 only); the reply is the storage slot it takes."""

    reply: ClassVar[type[Message]] = Slot
    party: int
    version: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageInfo(Request):
    """More of ``version``'s info; ``readable``: receivers of a pipelined transport may start
    reading it (the sender is still writing)."""

    party: int
    version: int
    info: WireMap
    readable: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Staged(Request):
    party: int
    version: int
    info: WireMap
    stage_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Part(Message):
    """Where a sharded version's rows go: its slot and what rank 0 announced of it."""

    slot: int
    info: WireMap


@dataclasses.dataclass(frozen=True, kw_only=True)
class BeginPart(Request):
    """A sending rank other than 0 of a sharded session: wait until rank 0 opened ``version``
    for every rank's rows; the reply says where they go."""

    reply: ClassVar[type[Message]] = Part
    party: int
    version: int
    timeout: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartStaged(Request):
    """A sending rank other than 0 wrote its rows of ``version``; ``info``: its part of the
    version's record (the digests of the buckets it finished)."""

    party: int
    version: int
    info: WireMap


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parts(Message):
    parts: list[WireMap]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WaitParts(Request):
    """Sender rank 0 of a sharded session: wait until the ``count`` other sending ranks wrote
    their rows of ``version``; their parts. Raises naming a rank that failed or was lost
    (the version is aborted)."""

    reply: ClassVar[type[Message]] = Parts
    party: int
    version: int
    count: int
    timeout: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Abort(Request):
    party: int
    version: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class BeginSync(Request):
    """The barrier; the reply names the participants of ``version``."""

    reply: ClassVar[type[Message]] = Participants
    party: int
    version: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class WaitOutcome(Request):
    """Until ``version`` committed (its metrics) or failed (SyncFailed naming each failed
    party); ``info``: more of the version's info first (as StageInfo), in the same call."""

    reply: ClassVar[type[Message]] = Metrics
    party: int
    version: int
    timeout: float
    info: WireMap | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class WaitVersion(Request):
    """Receivers: until ``version`` (None: anything newer than what they serve) can be read.
    ``prefetch``: only to read ahead, not applied yet; ``after``: nothing at or below it (what
    an ahead thread took already); ``ahead``: the caller is an ahead thread (receiver.py: AheadThread)."""

    reply: ClassVar[type[Message]] = Target
    party: int
    version: int | None
    timeout: float
    wait: bool = True
    prefetch: bool = False
    after: int | None = None
    ahead: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class GetState(Request):
    """A version's state and reason (the abort checks of a party that waits); not the version
    table's State (records.State)."""

    reply: ClassVar[type[Message]] = VersionState
    party: int
    version: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report(Request):
    party: int
    version: int
    ok: bool
    serving: int | None
    reason: str = ""
    metrics: ReceiverMetrics | None = None  # a committed version's; a failure reports none


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckBatch(Request):
    """A rollout batch's weight version against the staleness bound."""

    reply: ClassVar[type[Message]] = Lag
    party: int = 0
    batch_version: int
    step: int
    max_staleness: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class GetStatus(Request):
    reply: ClassVar[type[Message]] = Status
    op: ClassVar[str] = "status"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GetMetrics(Request):
    """One version as status() shows it."""

    reply: ClassVar[type[Message]] = Metrics
    op: ClassVar[str] = "metrics"
    version: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Channel(Request):
    """The address of the control channel, opened at the first ask; a coordinator whose config
    says ``control_channel: ray`` refuses (ProtocolError), and clients keep to Ray."""

    reply: ClassVar[type[Message]] = ChannelAddress


@dataclasses.dataclass(frozen=True, kw_only=True)
class BcastForm(Request):
    """Sender rank 0, right after begin_sync: fix the group of ``version``. ``ahead``: in
    stage() instead, with every live receiver, if each one's ahead thread is ready."""

    reply: ClassVar[type[Message]] = Formed
    party: int
    version: int
    ahead: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class BcastGroup(Request):
    """Receivers: until the group of ``version`` is formed; with this receiver's rank."""

    reply: ClassVar[type[Message]] = BroadcastGroup
    party: int
    version: int
    timeout: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class BcastCheck(Request):
    """Polled by a party whose collective is slow: is the version still on, who is lost?"""

    reply: ClassVar[type[Message]] = GroupCheck
    party: int
    version: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class SegmentRef(Message):
    """Where a relay version lies on a host: the segment its host's relaying party writes."""

    leader: str
    ref: str  # the segment's reference (transports/shm/transport.py: Segment.ref)
    size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class SegmentAt(Request):
    """A party that relays ``version`` to its host (or the sender, to its own) writes it into
    the segment ``ref``; the receivers of its host read it from there."""

    party: int
    version: int
    ref: str
    size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class SegmentOf(Request):
    """A relay follower: where its host's relaying party writes ``version`` (waits for it)."""

    reply: ClassVar[type[Message]] = SegmentRef
    party: int
    version: int
    timeout: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class BcastFailed(Request):
    """A member's collective failed: abort ``version`` for everyone; the reply is the abort
    reason, naming the party at fault."""

    reply: ClassVar[type[Message]] = Reason
    party: int
    version: int
    error: str
    timeout: float



Handler = Callable[[Any, Any], Awaitable[Message]]
# request type -> the coordinator's handler of it; filled by @handles as the actor's class
# body runs, so the table is complete at import and a second handler of one request fails there
HANDLERS: dict[type[Request], Handler] = {}


def handles(request: type[Request]) -> Callable[[Handler], Handler]:
    """Mark a coordinator method as the one handler of ``request`` (coordinator/actor.py)."""

    def mark(fn: Handler) -> Handler:
        if request in HANDLERS:
            raise TypeError(f"{request.__name__} already has a handler: {HANDLERS[request].__name__}")
        HANDLERS[request] = fn
        return fn

    return mark
