"""Internal. Typed records and their wire form, for everything that crosses a process boundary: msgpack
encoding and strict decoding. The control plane's records (coordinator/ops.py) and the transports'
(transports/base.py) are dataclasses decoded here by their fields and type hints, so a record
declares its shape once and a field missing, unknown or of the wrong type is a ProtocolError
naming the record and the field, at the first message, not a KeyError deep in a transfer.

Msgpack only, so no message that crossed a process boundary is ever unpickled: Ray or the
coordinator's channel still carry the bytes, but what they decode to is plain data (dicts,
lists, str, int, float, bytes), never code.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import msgpack
from typing_extensions import TypeAliasType  # typing's own from Python 3.12

from .errors import ProtocolError

MAX_MESSAGE_BYTES = 64 << 20

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


# -- the records a transport publishes ----------------------------------------------------------
#
# A transport's sender publishes a session record once (rendezvous, digest kind) and a version
# record per version (where the bytes are); the coordinator stores and forwards their wire forms
# without reading them and each receiver parses them back where they arrive. A plugin transport
# brings its own subclasses and names them in its declaration (transports/base.Transport).

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

    # the coordinator notes a broadcast version's group here for metrics
    foreign: typing.ClassVar[frozenset[str]] = frozenset({"group"})
    digest: str | None = None  # of the whole version (digest.version_digest), once packed
    # a delta version's wire plan (the sender's delta: auto / on); None: the session plan
    delta: DeltaRecord | None = None

    def moves(self, plan: Any) -> Any:
        """The bucket lengths this version moves over the session ``plan`` (a manifest.BucketPlan),
        bucket for bucket: the plan's own, or the encoded lengths its delta record names, so a
        transport sizes what it reads without knowing what the bytes mean."""
        return plan if self.delta is None else plan.with_lengths(self.delta.lengths)
