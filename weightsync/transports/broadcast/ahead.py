"""Internal. The broadcast receiver's side of ``receive_ahead``: a version the sender sent in stage() is
taken by the receiver's ahead thread (receive_ahead.py) through the same collective as at the
barrier, into a shadow (shadow.py), every bucket verified as it lands; apply() then yields
the buckets from the shadow, so the barrier moves no byte over the wire and hashes nothing.
A version sent at the barrier (the first one, or one with a receiver not ready) takes the
collective path in apply() as before. On a device the ahead collective runs on the shadow's
own stream, not on the engine's (shadow.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ... import digest
from ...digest import as_int
from ...errors import ChecksumError, VersionError
from ..base import Received, VersionRecord
from ..shadow import Shadow
from .records import BroadcastVersion


class AheadReceiver:
    """Mixed into BroadcastReceiver, before its collective end and ReceiverTransport."""

    ctx: Any
    digest_kind: str | None
    session: Any
    device: torch.device
    shadow: Shadow | None

    def _collective(self, version: int, info: BroadcastVersion, deadline: float,
                    check: Callable[[], None]) -> Iterator[Received]:
        raise NotImplementedError

    def open_ahead(self) -> int | None:
        """Allocate the shadow where the sender sends ahead; its bytes, or None (not ahead).

        Raises:
            CapacityError: one copy of the payload exceeds ``receive_ahead_max_mb``.
        """
        if not self.session.ahead or self.ctx.config.receive_ahead == "off":
            return None
        if self.shadow is None:
            self.shadow = Shadow(self.ctx.plan, self.device, f"receiver '{self.ctx.name}'", self.ctx.config)
            self.ctx.account("ahead_shadow_bytes", +self.shadow.nbytes)
        return self.shadow.nbytes

    def prefetch(self, version: int, info: BroadcastVersion, deadline: float, check: Callable[[], None]) -> bool:
        """Take a version sent ahead into the shadow; True if it came in whole and verified. A
        bad bucket does not leave the collective (the other members' transfer goes on); the
        version fails when apply() comes for it. Raises what broke the collective (the version
        is aborted, naming the fault)."""
        if not info.ahead or self.shadow is None:
            return False
        shadow = self.shadow
        bad: BaseException | None = None
        # on a device, the collective, the copies and the digests are queued on the shadow's own
        # stream: the engine keeps generating on its stream meanwhile (shadow.py)
        with shadow.writing():
            shadow.begin(version)
            try:
                for b, wire, expected in self._collective(version, info, deadline, check):
                    into = shadow.bucket(b, wire.numel())
                    into.copy_(wire)
                    expected = None if expected is None else as_int(expected)
                    shadow.digests.append(expected)
                    if bad is None and expected is not None and self.digest_kind is not None:
                        try:
                            # the shadow's copy is what the barrier loads: verify that one, now
                            # (off the barrier: this thread may wait for the device)
                            digest.verify(self.digest_kind, b, into, expected, version)
                        except ChecksumError as exc:
                            bad = exc
            except BaseException as exc:
                shadow.finish(version, exc)
                raise
            shadow.finish(version, bad)
        return bad is None

    def receive(self, version: int, info: BroadcastVersion, deadline: float,
                check: Callable[[], None]) -> Iterator[Received]:
        if not info.ahead:
            yield from self._collective(version, info, deadline, check)
            return
        if self.shadow is None:
            raise VersionError(f"version {version} was sent ahead but receiver '{self.ctx.name}' keeps no shadow "
                               f"(receive_ahead: off here; use one config for every party)")
        self.shadow.wait(version, deadline, check)
        yield from self.shadow.buckets(self.plan_of(info))

    def received_ahead(self, version: int, info: VersionRecord) -> bool:
        return isinstance(info, BroadcastVersion) and info.ahead

    def verify_bucket(self, version: int, info: VersionRecord, b: int, buf: torch.Tensor,
                      expected: int | torch.Tensor | None, checks: digest.Checks) -> bool:
        if self.received_ahead(version, info):
            if expected is not None and self.digest_kind is not None:
                checks.add(self.digest_kind, b, expected)  # for the version's digest
            return False  # verified in the shadow as it arrived, by this very receiver
        return super().verify_bucket(version, info, b, buf, expected, checks)  # type: ignore[misc]

    def span(self, version: int, info: VersionRecord) -> Callable[[int, int, int], torch.Tensor | None] | None:
        if self.received_ahead(version, info) and self.shadow is not None:
            return self.shadow.span()
        return None
