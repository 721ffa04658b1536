"""Fault points installed from outside a party, on its transport object, so production classes
carry no test hooks (parties.py uses them; so does the vLLM tier's trainer).

- On the wire (``edit_packed``): the Packer a sender transport is handed in ``stage`` is wrapped
  so that once bucket b is filled and its digest taken, an edit changes its bytes before the
  transport may publish it: every transport publishes bucket b only after ``fill(b, ...)``
  returned (shm sets its ready word, the ipc ring publishes it, broadcast launches it).
  Full and delta versions alike: both reach the transport as a packer.
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


class _EditedPacker:
    """A packer (full or delta-encoded) whose bucket ``b`` is edited once filled and digested."""

    def __init__(self, packer: Any, version: int, edit: Edit):
        self._packer, self._version, self._edit = packer, version, edit

    def fill(self, b: int, dst: torch.Tensor, kind: str | None = None, views: Any = None) -> Any:
        value = self._packer.fill(b, dst, kind, views)  # taken over the clean bytes (a device digest is queued first)
        self._edit(self._version, b, dst[: self._packer.plan.buckets[b].nbytes])
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packer, name)


def edit_packed(transport: Any, edit: Edit | None) -> None:
    """From now on, every version this sender transport stages is packed through ``edit``
    (None: unchanged again). Wraps the instance's ``stage`` once; a later call replaces the edit."""
    wrapper = vars(transport).get("stage")
    if wrapper is None:
        original = transport.stage

        def wrapper(version: int, slot: int, packer: Any) -> Any:
            if wrapper.edit is not None:
                packer = _EditedPacker(packer, version, wrapper.edit)
            return original(version, slot, packer)

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
            for bucket in received:
                yield bucket
                self._gate((version, bucket.index))
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
