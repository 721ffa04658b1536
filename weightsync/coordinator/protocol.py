"""Control-plane encoding: msgpack only, so no message that crossed a process boundary is
ever unpickled. Ray still carries the bytes between processes, but what they decode to is
plain data (dicts, lists, str, int, float, bytes), never code."""

from __future__ import annotations

from typing import Any

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
