"""The log lines of a version's life, one per party and version, through :mod:`logging`
(logger ``weightsync``): INFO when the party is done with the version, WARNING when it failed
there, DEBUG per bucket. A job's logs then tell which version each party served, what it cost
and who failed, without a call to ``status()``.

    weightsync: sender trainer-0 v7 committed shm 1.17 GiB stage 0.210s barrier 0.034s receivers rollout-0,rollout-1
    weightsync: receiver rollout-1 v7 failed shm after 3/104 buckets 0.081s: ChecksumError: ...; rolled back to version 6
"""

from __future__ import annotations

import logging

log = logging.getLogger("weightsync")


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def sent(party: str, version: int, transport: str | None, nbytes: int, stage_s: float, barrier_s: float,
         committed: list[str]) -> None:
    log.info("sender %s v%d committed %s %s stage %.3fs barrier %.3fs receivers %s", party, version, transport,
             _size(nbytes), stage_s, barrier_s, ",".join(sorted(committed)) or "-")


def send_failed(party: str, version: int, transport: str | None, seconds: float, why: str) -> None:
    log.warning("sender %s v%d failed %s after %.3fs: %s", party, version, transport, seconds, why)


def applied(party: str, version: int, transport: str | None, nbytes: int, seconds: float) -> None:
    log.info("receiver %s v%d committed %s %s %.3fs", party, version, transport, _size(nbytes), seconds)


def apply_failed(party: str, version: int, transport: str | None, buckets: int, total: int, seconds: float,
                 why: str) -> None:
    log.warning("receiver %s v%d failed %s after %d/%d buckets %.3fs: %s", party, version, transport, buckets, total,
                seconds, why)


def bucket(party: str, version: int, index: int, nbytes: int) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s v%d bucket %d %s", party, version, index, _size(nbytes))
