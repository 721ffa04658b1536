"""Internal. Trainer side. Rank 0 stages and sends; other trainer ranks iterate in lockstep only,
except in a sharded session, where every rank writes its own rows (below).

One version, end to end:  stage(v, named_tensors)
  -> the first version fixes the session: manifest, bucket plan, transport (transports.choose)
  -> coordinator.begin_stage(v) picks the storage slot
  -> a Packer over the tensors (manifest.py), or delta sync's encoded buckets (delta/sender.py)
  -> transport.announce(v) where receivers may read while it is written -> coordinator.stage_info
  -> transport.stage(v, packer): the transport fills its buckets from the packer, now or at send()
  -> coordinator.staged(v)                     ... the trainer is free again
sync(v)  -> coordinator.begin_sync(v) -> transport.send(v) -> coordinator.wait_outcome(v)

A sharded session (the first version's tensors are FSDP2 shards, manifest.shards_of, on a transport
that takes rows: shm whole versions, relay, broadcast): on shm rank 0 opens v (announce), every other rank joins it
(coordinator.begin_part) and writes its rows into the same segment, reporting its part
(coordinator.part_staged); rank 0 writes its own, collects the parts (coordinator.wait_parts:
a rank lost meanwhile aborts v, named) and merges them into v's record. On relay and broadcast,
which move versions at the barrier, every rank keeps its rows (a RowWriter: rank 0's goes to
transport.stage in a Packer's place) and sends them in sync(v) (transport.send on rank 0,
SendsRows.send_rows on the others, each reporting its part). Elsewhere every rank gathers each
DTensor with ``full_tensor()`` as the tensors are walked (manifest.gathered).

Each version ends in one line through :mod:`logging` (logger ``weightsync``): INFO once it is
committed, WARNING where it failed (the receivers write theirs, receiver.py), so a job's logs
tell which version went where, what it cost and who failed, without a call to ``status()``:

    weightsync: sender trainer-0 v7 committed shm 1.17 GiB stage 0.210s barrier 0.034s receivers rollout-0,rollout-1
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from . import transports
from .config import SyncConfig
from .coordinator.client import Coordinator, HoldsMember, Member
from .delta.policy import FULL
from .delta.sender import DeltaSender, host_reserve, wanted
from .errors import ConfigError, ManifestError, SyncFailed, VersionError, WeightSyncError
from .manifest import (
    Manifest,
    NamedTensors,
    Packer,
    RowPlan,
    RowWriter,
    build_manifest,
    gathered,
    is_dtensor,
    plan_buckets,
    plan_rows,
    shards_of,
    size_text,
)
from .records import Metrics, Publication, VersionRecord
from .transports import (
    Announces,
    Deadline,
    GivesBack,
    SenderTransport,
    SendsRows,
    SendsRowsAhead,
    TransportContext,
    WritesRows,
)

log = logging.getLogger("weightsync")


@dataclasses.dataclass
class SyncResult:
    """What one version cost, as ``WeightSender.sync()`` returns it.

    Attributes:
        version: The version that committed.
        stage_s: Seconds its staging took.
        barrier_s: Seconds from the barrier until every receiver committed.
        bytes: Payload bytes of the version.
        metrics: The coordinator's per-version record (as ``Coordinator.metrics`` gives it),
            with each receiver's measurements in ``metrics.receivers``.
        stage_calls: Coordinator calls this sender made to stage the version.
        sync_calls: Coordinator calls this sender made in ``sync()``.
    """

    version: int
    stage_s: float
    barrier_s: float
    bytes: int
    metrics: Metrics
    stage_calls: int = 0
    sync_calls: int = 0

    @property
    def gbps(self) -> float:
        """Payload GB/s over staging plus barrier (infinite for a zero duration)."""
        total = self.stage_s + self.barrier_s
        return self.bytes / total / 1e9 if total > 0 else float("inf")

    @property
    def wire_bytes(self) -> int:
        """Bytes the version moved to the receiver that got the most, as receivers report them:
        the payload for a full version, the encoded buckets for a delta (0 when none reported)."""
        return max((m.bytes for m in self.metrics.receivers.values()), default=0)


class StagedVersion:
    """Handle of a staged (or staging) version; ``wait()`` re-raises a staging error.

    Args:
        version: The version being staged.
        future: The staging's future (done at once unless staged in the background).
    """

    def __init__(self, version: int, future: concurrent.futures.Future):
        self.version, self._future = version, future

    def done(self) -> bool:
        """Whether the staging finished (or failed).

        Returns:
            True once it finished or failed.
        """
        return self._future.done()

    def wait(self, timeout: float | None = None) -> float:
        """Wait for the staging to finish.

        Args:
            timeout: Seconds to wait at most; None waits as long as it takes.

        Returns:
            Seconds the staging took.

        Raises:
            TimeoutError: It did not finish within ``timeout``.
            WeightSyncError: The staging failed; its own error is re-raised (e.g. a
                ManifestError naming the tensor).
        """
        return self._future.result(timeout)


class WeightSender(HoldsMember):
    """Trainer-side end of a session.

    ``rank`` is the trainer rank: rank 0 sends, every other rank must still call ``stage``
    and ``sync`` with the same versions (their tensor iteration may run collectives such as
    FSDP's ``full_tensor()``), and sends nothing, unless the tensors are FSDP2 shards
    (DTensors sharded by rows) on shm, relay or broadcast: then every rank sends its own rows
    (docs/sharded.md). The constructor registers with the
    coordinator and starts a heartbeat thread; ``close()`` (or a ``with`` block) leaves.

    Args:
        coordinator: The job's coordinator handle.
        rank: The trainer rank; rank 0 sends.
        name: The party's name in errors and status; ``trainer-<rank>`` when None.
        config: This party's configuration; the coordinator's when None.
        expected_receivers: How many receivers the first ``stage`` waits for before it
            chooses the transport (None or 0: those registered by then).
        device: Where the tensors live (``cpu``, ``cuda``, ``npu``, ``cuda:1``, ...); the
            config's ``device`` when None.

    Raises:
        WeightSyncError: The coordinator is unreachable or refused the registration.
        DeadlineExceeded: It did not answer within ``connect_timeout_s``.
    """

    role = "sender"

    def __init__(self, coordinator: Coordinator, *, rank: int = 0, name: str | None = None,
                 config: SyncConfig | None = None, expected_receivers: int | None = None,
                 device: str | None = None):
        # registration, heartbeat and rejoin; what a restarted coordinator must learn is pushed
        # to it as it changes (member.remember)
        self.member = Member(coordinator, role=self.role, name=name or f"trainer-{rank}", rank=rank, config=config,
                             device=device)
        self.expected_receivers = expected_receivers
        self.manifest: Manifest | None = None
        self.transport: SenderTransport | None = None
        self.transport_name: str | None = None
        self._staged: dict[int, StagedVersion] = {}
        self._stage_calls: dict[int, int] = {}  # coordinator calls each staged version took
        self._staged_digest: dict[int, str | None] = {}  # version digests reported when staged
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"weightsync-stage-{self.name}")
        # delta sync's snapshot and diff (config delta: auto / on, where the transport is slow enough)
        self._delta: DeltaSender | None = None
        self._encoded: set[int] = set()  # recent versions sent as delta-encoded buckets
        # a sharded session: where this rank's rows go (None: rank 0 sends whole tensors);
        # ranks other than 0 learn it from the publication, with the first version of DTensors
        self.rows: RowPlan | None = None
        self._rows_due: dict[int, RowWriter] = {}  # a rank's rows that go at the barrier (SendsRows)
        self._learned = False
        self.open()

    def close(self) -> None:
        """Release the transport's resources and leave the session. Idempotent; a ``with``
        block calls it on exit."""
        if self.member.closed:
            return
        try:
            self._pool.shutdown(wait=True)
            if self.transport is not None:
                self.transport.close()
        finally:
            self.member.close()

    @property
    def sends(self) -> bool:
        """Whether this rank moves bytes (rank 0) or only iterates in lockstep."""
        return self.rank == 0

    # -- session set-up ------------------------------------------------------------------

    def publish(self, manifest: Manifest) -> None:
        """Fix the session's layout and transport; done by the first ``stage`` if not before.

        Waits for ``expected_receivers``, chooses the transport (``transport: auto`` picks by
        placement) and publishes manifest, plan and transport to the coordinator. A second
        call does nothing.

        Args:
            manifest: The layout every version of the session carries.

        Raises:
            DeadlineExceeded: The expected receivers did not register within ``connect_timeout_s``.
            ConfigError: The requested transport cannot work for this placement (the message
                says why).
            WeightSyncError: The coordinator refused the publication.
        """
        if self.transport is not None:
            return
        digest = manifest.digest()
        config = self.config
        plan = plan_buckets(manifest, config.bucket_bytes, config.align_bytes)
        receivers = self.control.receivers(self.expected_receivers or 0, timeout=config.connect_timeout_s)
        name, reason = transports.choose(config.transport, self.member.placement, receivers, config.backend,
                                         config.shm_dir)
        delta = config.delta != "off" and wanted(config.delta, name)  # delta sync runs in this session
        ctx = TransportContext(config=config, plan=plan, manifest=manifest, digest=digest, session=self.session,
                               name=self.name, rank=self.rank, device=self.device, member=self.member,
                               host_reserve=host_reserve(config.delta, name, plan) if delta else 0)
        transport = transports.get(name).sender(ctx)
        session = transport.session
        sharded = (manifest.rows is not None and not delta
                   and (isinstance(transport, WritesRows) and isinstance(transport, Announces)
                        or isinstance(transport, SendsRows)))
        if manifest.rows is not None and not sharded:
            manifest = manifest.whole()  # every rank gathers its shards; rank 0 sends them whole
            reason = f"{reason}; the FSDP2 shards are gathered ({_why_gathered(name, delta)})"
        if config.receive_ahead == "on" and not session.ahead:
            transport.close()
            raise ConfigError(f"receive_ahead: on, but transport {name} ({session.why or reason}) takes "
                              f"versions at the barrier only; use broadcast or whole-version shm, or receive_ahead: auto")
        if session.why:
            reason = f"{reason}; {session.why}"
        log.info("weightsync session %s: transport %s (%s)", self.session, name, reason)
        # receivers may read a version as soon as it is announced (shm's segment, broadcast's ahead group)
        pipelined = isinstance(transport, Announces) and session.ahead
        publication = Publication(manifest.to_wire(), digest, plan.payload_bytes, name, reason,
                                  session.to_wire(), pipelined, session.keeps_versions, senders=manifest.senders)
        try:
            self.control.publish(publication)
        except BaseException:
            transport.close()
            raise
        self.member.remember(publication=publication)  # a restarted coordinator gets it again
        self.manifest, self.transport, self.transport_name, self.plan = manifest, transport, name, plan
        self.rows = plan_rows(plan, manifest, 0) if sharded else None
        if self.sends and delta:
            self._delta = DeltaSender(plan, manifest, config.delta)

    # -- per version ---------------------------------------------------------------------

    def stage(self, version: int, named_tensors: NamedTensors, background: bool = False) -> StagedVersion:
        """Pack ``version`` for sending; may run while the rollout is still generating.

        With ``background=True`` the packing runs in a thread and this returns at once; the
        tensors must then stay unchanged until the handle is done (``sync`` waits for it).
        On ipc and streaming shm the bytes move in ``sync``, so the tensors must stay unchanged
        until it returns. The first version fixes the manifest and the transport (``publish()``).

        Args:
            version: The version number; greater than every version staged before.
            named_tensors: A mapping name -> tensor, or an iterable of (name, tensor) pairs,
                in the same order and with the same names, dtypes and shapes every version.
                A DTensor stands for its full tensor: this rank's shard of it.
            background: Pack in a thread and return at once.

        Returns:
            The version's handle; ``wait()`` gives the staging's seconds or re-raises its error.

        Raises:
            VersionError: ``version`` was already staged, or is not newer than the last one.
            ManifestError: The tensors differ from the session's manifest (names the tensor).
            ConfigError: The first version found the requested transport cannot work here.
            CapacityError: The shm budget cannot hold even a streaming ring.
        """
        if version in self._staged:
            raise VersionError(f"version {version} was already staged by {self.name}")
        if background:
            future = self._pool.submit(self._stage, version, named_tensors)
        else:
            future = concurrent.futures.Future()
            try:
                future.set_result(self._stage(version, named_tensors))
            except BaseException as exc:
                future.set_exception(exc)
                raise
        handle = self._staged[version] = StagedVersion(version, future)
        return handle

    def withdraw(self, version: int, why: str) -> bool:
        """Give up a staged version whose bytes would move only at the barrier (broadcast when
        not every receiver takes it ahead, ipc, streaming shm): for a caller that staged it in
        a call of its own, right after the optimizer step, whose other trainer ranks walked
        their tensors in that call already. The version is aborted with ``why``; the next
        sync stages a newer one. False (nothing changes) where stage() moved the bytes.

        Args:
            version: A version this sender staged and did not sync.
            why: The abort reason the coordinator records.

        Returns:
            True if the version was given up.
        """
        handle = self._staged.get(version)
        if handle is None or not self.sends or self.transport is None:
            return False
        handle.wait()
        if not (isinstance(self.transport, GivesBack) and self.transport.give_back(version)):
            return False
        del self._staged[version]
        try:
            self.control.abort(version, why)
        except Exception:
            pass  # aborted already, or the coordinator is gone: the version cannot commit either way
        return True

    def _stage(self, version: int, named: NamedTensors) -> float:
        t0, made = time.perf_counter(), self.control.made()
        try:
            return self._stage_counted(version, named, t0)
        finally:
            self._stage_calls[version] = self.control.made() - made  # in the thread that staged

    def _stage_counted(self, version: int, named: NamedTensors, t0: float) -> float:
        if not self.sends:
            self._walk(version, named)
            return time.perf_counter() - t0
        if self.transport is None:
            if not isinstance(named, Mapping):
                named = list(named)  # the first version fixes the manifest: we need it whole
            manifest = build_manifest(named)
            shards = shards_of(list(named.items()) if isinstance(named, Mapping) else named)
            if shards is not None and shards.rank == 0:
                manifest = Manifest(manifest.specs, shards.rows)
            self.publish(manifest)
        slot = self.control.begin_stage(version)
        self.member.remember(last_version=version)  # a restarted coordinator never reuses it
        try:
            if self.rows is not None and not isinstance(self.transport, SendsRows):
                record = self._write_rows(version, slot, named)
                stage_s = time.perf_counter() - t0
                self.control.staged(version, record.to_wire(), stage_s)
                return stage_s
            packer, delta = self._packer(version, named)
            if isinstance(self.transport, Announces):
                early = self.transport.announce(version, slot)
                if early is not None:  # receivers may read it from now on, while it is written
                    self.control.stage_info(version, self._with(early, delta).to_wire(), readable=True)
            record = self._with(self.transport.stage(version, slot, packer), delta)
            stage_s = time.perf_counter() - t0
            self.control.staged(version, record.to_wire(), stage_s)
            self._staged_digest = {v: d for v, d in self._staged_digest.items() if v > version - 8}
            self._staged_digest[version] = record.digest
        except BaseException as exc:
            self._resolved(version, committed=False)
            self._abort(version, "staging", exc)
            raise
        return stage_s

    def _abort(self, version: int, step: str, exc: BaseException) -> None:
        """This rank's ``step`` of ``version`` failed: abort the version with the reason, so that
        receivers waiting for its bytes learn at once that none will come."""
        try:
            self.control.abort(version, f"{step} failed: {type(exc).__name__}: {exc}")
        except Exception:
            pass  # aborted already, or the coordinator is gone: the version cannot commit either way

    def _walked(self, version: int, named: NamedTensors) -> Iterator[tuple[str, Any]]:
        """The tensors as rank 0 walks them, DTensors gathered. Where the walk breaks because
        another trainer rank died (a collective such as ``full_tensor()`` fails here: gloo says
        the connection closed), wait until the coordinator sees that rank gone (heartbeat_timeout_s
        at most) and raise a SyncFailed naming it, whichever transport was walking."""
        walk = iter(gathered(named))
        while True:
            try:
                item = next(walk)
            except StopIteration:
                return
            except Exception as exc:
                if isinstance(exc, WeightSyncError):
                    raise
                try:
                    lost = self._lost_ranks()
                except Exception:
                    lost = {}  # the coordinator is gone too: the error says what this rank saw
                if not lost:
                    raise
                raise SyncFailed(version, {**lost, self.name: f"its walk of the tensors failed: "
                                                            f"{type(exc).__name__}: {exc}"}) from exc
            yield item

    def _lost_ranks(self) -> dict[str, str]:
        """Trainer ranks other than 0 the coordinator finds dead, waiting for it to notice one
        where other ranks are registered (their heartbeats lapse within heartbeat_timeout_s)."""
        cfg = self.config
        deadline = time.monotonic() + cfg.heartbeat_timeout_s + 2 * cfg.heartbeat_interval_s
        while True:
            ranks = [p for p in self.coordinator.status().parties if p.role == "sender" and p.rank != 0]
            lost = {p.name: p.why for p in ranks if not p.alive and not p.left}
            if lost or not ranks or time.monotonic() >= deadline:
                return lost
            time.sleep(cfg.heartbeat_interval_s)

    def _write_rows(self, version: int, slot: int, named: NamedTensors) -> VersionRecord:
        """Rank 0 of a sharded session: open ``version`` for every rank, write this rank's rows,
        and once every other rank wrote theirs, the version's record from all the parts."""
        early = self.transport.announce(version, slot)
        self.control.stage_info(version, early.to_wire(), readable=True)  # the other ranks write from now on
        own = self.transport.write_rows(version, RowWriter(self.rows, self.manifest, named))
        parts = self.control.wait_parts(version, self.manifest.senders - 1, self.config.sync_timeout_s)
        return self.transport.merge(version, [own.to_wire(), *parts])

    def _walk(self, version: int, named: NamedTensors) -> None:
        """A rank other than 0: write this rank's rows of a sharded version, or walk the tensors
        in lockstep with rank 0 (the walk may be a collective: FSDP's ``full_tensor()``)."""
        items = named.items() if isinstance(named, Mapping) else named
        if not self._learned:
            items = iter(items)
            first = next(items, None)
            items = itertools.chain([first] if first is not None else [], items)
            if first is not None and is_dtensor(first[1]):
                items = list(items)  # DTensors: local shards, no gather has run yet
                self._learn(items)
        if self.rows is None:
            for _ in gathered(items):
                pass
            return
        if isinstance(self.transport, SendsRows):  # its rows go at the barrier (sync), or now if v goes ahead
            rows = RowWriter(self.rows, self.manifest, items)
            if self._ahead(version):
                self._send_rows(version, rows, Deadline(version, time.monotonic() + self.config.sync_timeout_s,
                                                        self.control))
                return
            self._rows_due = {v: w for v, w in self._rows_due.items() if v > version}
            self._rows_due[version] = rows
            return
        part = self.control.begin_part(version, self.config.sync_timeout_s)
        try:
            self.transport.join(version, transports.get(self.transport_name).version(part.info))
            rows = self.transport.write_rows(version, RowWriter(self.rows, self.manifest, items))
            self.control.part_staged(version, rows.to_wire())
        except BaseException as exc:
            self._abort(version, f"{self.name} writing its rows", exc)
            raise

    def _ahead(self, version: int) -> bool:
        """A rank other than 0 of a session whose versions may go before the barrier: whether
        rank 0 sends ``version`` now (its stage() formed the group ahead), as its record says once
        rank 0 announced or staged it."""
        if not (isinstance(self.transport, SendsRowsAhead) and self.transport.session.ahead):
            return False
        try:
            info = self.control.begin_part(version, self.config.sync_timeout_s).info
        except Exception as exc:
            self._abort(version, f"{self.name} waiting for rank 0 to stage", exc)
            raise
        return self.transport.went_ahead(transports.get(self.transport_name).version(info))

    def _send_rows(self, version: int, rows: RowWriter, deadline: Deadline) -> None:
        """A rank other than 0 at the barrier of a sharded version whose rows move then: send
        them and report what was sent. A failure aborts the version; the outcome's wait that
        follows raises SyncFailed naming who failed."""
        try:
            part = self.transport.send_rows(version, rows, deadline)
            self.control.part_staged(version, part.to_wire())
        except Exception as exc:
            # aborted already (then this changes nothing), or not yet: the first member would wait
            # for rows that never come
            self._abort(version, f"{self.name} sending its rows", exc)

    def _learn(self, items: list) -> None:
        """A rank other than 0, at its first version of DTensors: whether rank 0 made the session
        sharded (then this rank writes its rows from now on) or gathers."""
        self._learned = True
        info = self.control.session(self.config.sync_timeout_s)
        manifest = Manifest.from_wire(info.manifest)
        if manifest.rows is None:
            return
        shards = shards_of(items)
        if shards is None or shards.rows != manifest.rows:
            raise ManifestError(f"{self.name}: its shards split the tensors otherwise than sender rank 0 published")
        plan = plan_buckets(manifest, self.config.bucket_bytes, self.config.align_bytes)
        declared = transports.get(info.transport)
        ctx = TransportContext(config=self.config, plan=plan, manifest=manifest, digest=info.digest,
                               session=self.session, name=self.name, rank=shards.rank, device=self.device,
                               member=self.member)
        self.transport = declared.rows(ctx, declared.session(info.info))
        self.manifest, self.transport_name, self.plan = manifest, info.transport, plan
        self.rows = plan_rows(plan, manifest, shards.rank)

    def _packer(self, version: int, named: NamedTensors) -> tuple[Packer, VersionRecord | None]:
        """What the transport packs ``version`` from: the tensors (a Packer), or with delta sync
        the buckets it encoded against its snapshot; and, for a delta, the record fields it adds
        (its wire plan and the version's own digest: the transport's is of the encoded bytes)."""
        if self.rows is not None:  # a sharded session whose rows move at the barrier
            return RowWriter(self.rows, self.manifest, named), None
        if not isinstance(named, Mapping) or any(is_dtensor(t) for t in named.values()):
            named = self._walked(version, named)  # FSDP2 shards, sent whole: every rank gathers them in lockstep
        if self._delta is not None:
            held = [r.serving for r in self.control.receivers(0, self.config.connect_timeout_s)]
            if self._delta.way(held) != FULL:
                encoded, plan, digest = self._delta.prepare(version, named, held)
                self._encoded = {v for v in self._encoded if v > version - 8} | {version}
                return encoded, VersionRecord(delta=plan, digest=digest)
            self._delta.skip(version)  # auto measured full versions faster: sent as delta: off does
        return Packer(self.plan, self.manifest, named), None

    @staticmethod
    def _with(record: VersionRecord, delta: VersionRecord | None) -> VersionRecord:
        # a delta version's receivers read it by its wire plan from the first record on
        return record if delta is None else dataclasses.replace(record, delta=delta.delta, digest=delta.digest)

    def _resolved(self, version: int, committed: bool, seconds: float | None = None) -> None:
        if self._delta is not None:
            self._delta.resolved(version, committed=committed, seconds=seconds)

    def sync(self, version: int, timeout: float | None = None) -> SyncResult:
        """The barrier: returns once every receiver committed ``version``; raises SyncFailed
        naming who failed, within ``timeout`` (default ``sync_timeout_s``).

        Args:
            version: A version this sender staged.
            timeout: Seconds for the whole version; ``sync_timeout_s`` when None.

        Returns:
            What the version cost, with the coordinator's record of it.

        Raises:
            VersionError: ``version`` was never staged by this sender.
            SyncFailed: A receiver failed or went silent; ``failed`` maps each to why.
            DeadlineExceeded: The version did not finish within ``timeout``.
        """
        handle = self._staged.get(version)
        if handle is None:
            raise VersionError(f"sync({version}) was called but {self.name} never staged version {version}")
        stage_s = handle.wait()
        timeout = self.config.sync_timeout_s if timeout is None else timeout
        t0, made = time.perf_counter(), self.control.made()
        transport = self.transport_name
        try:
            late = None
            if self.sends:
                self.control.begin_sync(version)
                try:
                    digest = self.transport.send(version, Deadline(version, time.monotonic() + timeout, self.control))
                except Exception as exc:
                    self._abort(version, "sending", exc)
                    raise
                # transports that pack at the barrier know the version's digest only now: it
                # rides with the wait for the outcome (one call less per version); a delta
                # version's record has its own (the transport's is of the encoded bytes)
                if (digest is not None and version not in self._encoded
                        and digest != self._staged_digest.pop(version, None)):
                    late = VersionRecord(digest=digest).to_wire()
            elif version in self._rows_due:
                self._send_rows(version, self._rows_due.pop(version), Deadline(version, time.monotonic() + timeout,
                                                                               self.control))
            outcome = self.control.wait_outcome(version, timeout, info=late)
            self._resolved(version, committed=True, seconds=stage_s + time.perf_counter() - t0)
        except Exception as exc:
            self._resolved(version, committed=False)
            if self.sends:
                _log_send_failed(self.name, version, transport, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            for old in [v for v in self._staged if v <= version]:
                del self._staged[old]
        barrier_s = time.perf_counter() - t0
        stage_calls = self._stage_calls.pop(version, 0)
        self._stage_calls = {v: n for v, n in self._stage_calls.items() if v > version}
        result = SyncResult(version, stage_s, barrier_s, outcome.bytes, outcome, stage_calls=stage_calls,
                            sync_calls=self.control.made() - made)
        if self.sends:
            _log_sent(self.name, version, transport, result.bytes, stage_s, barrier_s, outcome.committed)
        return result

    def delta_state(self) -> dict[str, Any] | None:
        """Delta sync at this sender, for logs and benchmarks.

        Returns:
            None without delta; else ``base`` (the committed version the snapshot holds, or
            None) and, with ``delta: auto``, ``auto``: ``chosen`` (``delta``, ``full``, or None
            while a way is being timed) and ``delta_s`` / ``full_s``, the seconds it chose on.
        """
        if self._delta is None:
            return None
        policy = self._delta.policy
        return {"base": self._delta.base, **({"auto": policy.describe()} if policy is not None else {})}


def _why_gathered(name: str, delta: bool) -> str:
    """Why a session whose first version came as shards sends whole tensors: said in its reason
    (the log line and status()), since gathering costs more than the copy on one host."""
    if delta:
        return "delta sync encodes whole tensors"
    if name == "shm":
        return "shm streams through a ring here, the budget holding no whole version; ranks write rows into whole ones"
    return f"transport {name} takes no rows; shm, relay and broadcast do"


def _log_sent(party: str, version: int, transport: str | None, nbytes: int, stage_s: float, barrier_s: float,
              committed: list[str]) -> None:
    log.info("sender %s v%d committed %s %s stage %.3fs barrier %.3fs receivers %s", party, version, transport,
             size_text(nbytes), stage_s, barrier_s, ",".join(sorted(committed)) or "-")


def _log_send_failed(party: str, version: int, transport: str | None, seconds: float, why: str) -> None:
    log.warning("sender %s v%d failed %s after %.3fs: %s", party, version, transport, seconds, why)
