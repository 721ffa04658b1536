"""Fault points installed from outside a party, on its transport object, so production classes
carry no test hooks (parties.py uses them; so does the vLLM tier's trainer).

- On the wire (``edit_packed``): a sender transport's staged Packing is wrapped so that once
  bucket b is packed and its digest taken, an edit changes its bytes before the transport
  may publish it. The seam is the BucketSink contract (packing.py): ``done(b, digest)`` comes
  once b's last byte is in and its digest computed, before the next buffer is asked for;
  every transport publishes bucket b only after that (shm after pack_stream yields b; shm on
  an accelerator copies b from its device staging buffer to the segment from ``buffer(b + 1)``
  on; the ipc ring from ``buffer(b + 1)`` or after the yield, broadcast launches b in
  ``buffer(b + 1)`` or ``finish()``). Full and delta versions alike: both pack through
  ``Packing.into(sink, kind)``.
- In a receiver's load (``hold_receive``): the receiver's view of its transport is wrapped so
  that the receive generator, once the receiver resumes it after bucket b of a version
  (verified and loaded), first passes ``gate((version, b))``, which may block; the last
  bucket too, before the generator ends. Only the receiver's own load goes through the
  wrapper: a transport reading ahead on its own (prefetch, receive_ahead) is not held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from weightsync import device as devices
from weightsync.packing import BucketSink, Packing

# (version, bucket, the bucket's packed bytes) -> None, changing the bytes in place
Edit = Callable[[int, int, torch.Tensor], None]


def tampering(version: int, bucket: int, how: str) -> Edit:
    """An edit of bucket ``bucket`` of ``version`` only: flip one byte (``corrupt``) or zero
    its second half, as a short write leaves it (``truncate``)."""
    if how not in ("corrupt", "truncate"):
        raise ValueError(f"unknown tampering {how!r}")

    def edit(v: int, b: int, payload: torch.Tensor) -> None:
        if (v, b) != (version, bucket):
            return
        if how == "corrupt":
            payload[3] ^= 0x40
        else:
            tail = payload[payload.numel() // 2:]
            assert bool(tail.any()), "the cut must change the bytes"
            tail.zero_()
        # on a device the edit is queued on the stream: it must land before the bucket is
        # published, as the packed bytes did (a receiver could verify clean bytes, then load torn ones)
        devices.synchronize(payload.device)

    return edit


class _EditingSink(BucketSink):
    """Sits between a Packing and the transport's own sink: hands the transport's buffers
    through, and edits bucket b once ``done(b, digest)`` passed the digest on. The transport
    keeps calling its own sink directly; only the packing goes through this one."""

    def __init__(self, sink: BucketSink, version: int, packing: Packing, edit: Edit):
        self._sink, self._version, self._plan, self._edit = sink, version, packing.plan, edit
        self._buffers: dict[int, torch.Tensor] = {}

    def buffer(self, b: int) -> torch.Tensor:
        buf = self._buffers[b] = self._sink.buffer(b)
        return buf

    def done(self, b: int, digest: int | torch.Tensor | None) -> None:
        self._sink.done(b, digest)  # taken over the clean bytes (a device digest is queued first)
        buf = self._buffers.pop(b, None)
        if buf is not None:
            self._edit(self._version, b, buf[: self._plan.buckets[b].nbytes])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)


class _EditedPacking:
    """A staged Packing (full or delta-encoded) whose ``into`` packs through _EditingSink."""

    def __init__(self, packing: Packing, version: int, edit: Edit):
        self._packing, self._version, self._edit = packing, version, edit

    @property
    def plan(self) -> Any:
        return self._packing.plan

    def into(self, sink: BucketSink, kind: str | None) -> Iterator[int]:
        return self._packing.into(_EditingSink(sink, self._version, self._packing, self._edit), kind)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packing, name)


def edit_packed(transport: Any, edit: Edit | None) -> None:
    """From now on, every version this sender transport stages is packed through ``edit``
    (None: unchanged again). Wraps the instance's ``stage`` once; a later call replaces the edit."""
    wrapper = vars(transport).get("stage")
    if wrapper is None:
        original = transport.stage

        def wrapper(version: int, slot: int, packing: Packing, *args: Any, **kwargs: Any) -> Any:
            if wrapper.edit is not None:
                packing = _EditedPacking(packing, version, wrapper.edit)
            return original(version, slot, packing, *args, **kwargs)

        transport.stage = wrapper
    wrapper.edit = edit


class HeldTransport:
    """A receiver's transport, as the receiver's own load sees it: ``receive`` passes
    ``gate((version, bucket))`` each time the receiver comes back for the next bucket, i.e.
    once the bucket it was handed is loaded. Everything else is the transport's."""

    def __init__(self, transport: Any, gate: Callable[[tuple], None]):
        object.__setattr__(self, "_transport", transport)
        object.__setattr__(self, "_gate", gate)

    def receive(self, version: int, *args: Any, **kwargs: Any) -> Iterator[Any]:
        received = self._transport.receive(version, *args, **kwargs)
        try:
            for item in received:
                yield item
                self._gate((version, item[0]))
        finally:
            received.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._transport, name, value)


def hold_receive(receiver: Any, gate: Callable[[tuple], None]) -> None:
    """Put HeldTransport between ``receiver`` and its open session's transport (once)."""
    transport = receiver.transport
    if transport is not None and not isinstance(transport, HeldTransport):
        receiver.transport = HeldTransport(transport, gate)
