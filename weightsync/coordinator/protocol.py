"""Control-plane encoding: msgpack only, so no message that crossed a process boundary is
ever unpickled. Ray still carries the bytes between processes, but what they decode to is
plain data (dicts, lists, str, int, float, bytes), never code."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import msgpack

from ..errors import ProtocolError

MAX_MESSAGE_BYTES = 64 << 20


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


# -- typed records: one strict decoder for every record that crosses a process boundary --------
#
# A record is a dataclass; its wire form is plain data, field name -> value. Decoding is driven
# by the fields and their type hints, so a record declares its shape once and the control plane
# (weightsync/coordinator/ops.py) and the transports' records (transports/records.py) check it the same way:
# a field missing, unknown or of the wrong type is a ProtocolError naming the record and the
# field, at the first message, not a KeyError deep in a transfer.


def to_wire(record: Any) -> dict:
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
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
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
