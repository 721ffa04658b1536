"""Internal. Rollout side. A receiver serves exactly one complete version at a time, or none.

One version, end to end:  apply(v)
  -> coordinator.session(): manifest, checked against the model before any byte moves (first version)
  -> coordinator.wait_version(v): the version's record (where the bytes are)
  -> transport.receive(): bucket by bucket -> verified (here, or by the transport on its way in)
     -> unpacked into views (manifest.Unpacker; a delta version: rebuilt in delta sync's shadow,
        delta/receiver.py) -> load_weights
  -> post_load() once -> reset_cache() -> coordinator.report(ok) ... now serving v
On a failure after the first bucket was loaded the receiver loads the previous version again where
it can: from the transport (Replays: shm keeps it), or from delta sync's shadow; else it serves
nothing until it catches up.
With receive_ahead, a thread of the receiver (AheadThread) takes each version before apply() does.

Each version ends in one line through :mod:`logging` (logger ``weightsync``): INFO once served,
WARNING where it failed there, DEBUG per bucket:

    weightsync: receiver rollout-1 v7 failed shm after 3/104 buckets 0.081s: ChecksumError: ...; rolled back to version 6
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from . import transports
from .config import SyncConfig
from .coordinator.client import ControlPlane, Coordinator, HoldsMember, Member
from .delta.receiver import DeltaReceiver
from .digest import Checks, kind_of, version_digest
from .errors import CapacityError, DeadlineExceeded, ManifestError, VersionError, WeightSyncError
from .manifest import Expected, Manifest, Unpacker, check_manifest, plan_buckets, size_text
from .records import ReceiverMetrics, Served, State, VersionRecord
from .targets import LoadWeights
from .transports import (
    Deadline,
    Prefetches,
    ReceiverTransport,
    ReceivesAhead,
    Replays,
    Spans,
    Transport,
    TransportContext,
)

log = logging.getLogger("weightsync")


class WeightReceiver(HoldsMember):
    """Rollout-side end of a session: one per rollout worker process (one per vLLM TP rank).

    The constructor registers with the coordinator and starts a heartbeat thread; the
    session (manifest check, transport) opens at the first ``apply`` or ``prefetch``;
    ``close()`` (or a ``with`` block) leaves.

    Args:
        coordinator: The job's coordinator handle.
        load_weights: vLLM's contract: receives (name, tensor) pairs and copies them into
            the model; the tensors are views of transport buffers, valid during the call
            only. In place of the function, an engine target: an object with a
            ``load_weights`` method whose ``post_load``, ``reset_cache``, ``abort_load`` and
            ``expected`` attributes, where it has them, fill the arguments not given (e.g.
            ``weightsync_vllm.target.VllmTarget``).
        name: The party's name in errors and status; ``rollout-<rank>`` when None.
        rank: The rollout worker's rank.
        post_load: Runs once per version after the last bucket (e.g. vLLM's
            ``process_weights_after_loading``).
        expected: The model's tensors for the manifest check before any byte moves: a
            mapping name -> tensor or TensorSpec, or a callable returning a list of problems
            (see ``weightsync.manifest.check_manifest()``); None skips the check.
        reset_cache: Runs after ``post_load`` and drops what the engine computed with the old
            weights (vLLM: ``reset_prefix_cache``; without it a prefix-cached engine keeps
            serving KV blocks of the previous version); an exception or a ``False`` from it
            fails the version like a failed load.
        abort_load: Runs when a version fails after its first bucket reached
            ``load_weights``, before the rollback (a loader that stages buckets drops them).
        strict: A tensor ``expected`` holds but the manifest lacks fails the check too.
        config: This party's configuration; the coordinator's when None.
        device: Where the model lives (``cpu``, ``cuda``, ``npu``, ...); the config's
            ``device`` when None.

    Raises:
        WeightSyncError: The coordinator is unreachable or refused the registration.
        DeadlineExceeded: It did not answer within ``connect_timeout_s``.
    """

    role = "receiver"

    def __init__(self, coordinator: Coordinator, load_weights: LoadWeights | Any, *, name: str | None = None,
                 rank: int = 0, post_load: Callable[[], Any] | None = None, expected: Expected | None = None,
                 reset_cache: Callable[[], Any] | None = None, abort_load: Callable[[], Any] | None = None,
                 strict: bool = True, config: SyncConfig | None = None, device: str | None = None):
        if not callable(load_weights) and callable(getattr(load_weights, "load_weights", None)):
            target = load_weights
            load_weights = target.load_weights
            post_load = post_load if post_load is not None else getattr(target, "post_load", None)
            reset_cache = reset_cache if reset_cache is not None else getattr(target, "reset_cache", None)
            abort_load = abort_load if abort_load is not None else getattr(target, "abort_load", None)
            expected = expected if expected is not None else getattr(target, "expected", None)
        # registration, heartbeat and rejoin; what a restarted coordinator must learn is pushed
        # to it as it changes (member.remember)
        self.member = Member(coordinator, role=self.role, name=name or f"rollout-{rank}", rank=rank, config=config,
                             device=device)
        self.load_weights, self.post_load = load_weights, post_load
        self.reset_cache, self.abort_load = reset_cache, abort_load
        self.expected, self.strict = expected, strict
        self.transport: ReceiverTransport | None = None
        self.declared: Transport | None = None  # the session's transport as declared (its record parsers)
        self.unpacker: Unpacker | None = None
        self._generation = 0  # of the transport's buffers the unpacker's views show (Bucket.generation)
        self._kind: str | None = None  # the digest this receiver checks (None: off here)
        self._post_s = 0.0  # the last post-load hook's seconds
        self._version: int | None = None
        self._touched = False  # a bucket of the version being applied reached the model
        self._buckets_loaded = 0  # of the version being applied, for its log line
        self._served: VersionRecord | None = None  # where the served version's bytes are, for rollback
        self.shadow: DeltaReceiver | None = None  # delta sync's host copy of the served version, from the first delta
        self._session_lock = threading.Lock()  # prefetch() may run in a thread beside apply()
        self._ahead: AheadThread | None = None  # receive_ahead: takes versions before the barrier
        self.last_metrics: ReceiverMetrics | None = None  # of the last version it committed
        self.open()

    def close(self) -> None:
        """Stop the ahead thread, release the transport's resources and leave the session.
        Idempotent; a ``with`` block calls it on exit."""
        if self.member.closed:
            return
        try:
            if self._ahead is not None:
                self._ahead.stop()
            if self.transport is not None:
                self.transport.close()
        finally:
            self.member.close()

    @property
    def version(self) -> int | None:
        """The version whose weights this receiver holds completely, or None."""
        return self._version

    def _ensure_session(self, timeout: float) -> None:
        with self._session_lock:
            if self.transport is None:
                self._open_session(timeout)

    def _open_session(self, timeout: float) -> None:
        session = self.control.session(timeout)
        manifest = Manifest.from_wire(session.manifest)
        if manifest.digest() != session.digest:
            raise ManifestError("the manifest received differs from its digest")
        if self.expected is not None:
            try:
                check_manifest(manifest, self.expected, strict=self.strict)
            except ManifestError as exc:
                self.control.verdict(False, why=str(exc))
                raise
        self.control.verdict(True)
        self.member.remember(accepted=True)  # a restarted coordinator hears it again
        declared = transports.get(session.transport)
        record = declared.session(session.info)  # a malformed one: ProtocolError naming the transport and field
        plan = plan_buckets(manifest, self.config.bucket_bytes, self.config.align_bytes)
        # the sender's digest kind, unless this receiver's own config turns digests off
        kind = record.digest_kind if kind_of(self.config, self.device) is not None else None
        ctx = TransportContext(config=self.config, plan=plan, manifest=manifest, digest=session.digest,
                               session=self.session, name=self.name, rank=self.rank, device=self.device,
                               member=self.member, digest_kind=kind)
        transport = declared.receiver(ctx, record)
        self.transport, self.declared, self.unpacker, self._kind = transport, declared, Unpacker(plan, manifest), kind
        try:
            self._ahead = AheadThread.start(self.name, self.config, self.control, transport, declared)
        except BaseException:
            self.transport = None
            transport.close()
            raise

    def apply(self, version: int | None = None, timeout: float | None = None, wait: bool = True) -> int | None:
        """Receive, verify and load a version, run the post-load hook, reset the cache, commit.

        On a failure after the first bucket reached the model, the previous version is loaded
        again when the transport still holds it (shm), else the receiver serves no version
        until the next one; either way the error is raised after it was reported.

        Args:
            version: The version to load; None: the newest one on its way, else the latest
                committed one newer than what is served.
            timeout: Seconds to wait for the version and load it; ``sync_timeout_s`` when None.
            wait: With False, return at once when there is nothing newer.

        Returns:
            The version served afterwards (None when none).

        Raises:
            VersionError: ``version`` is older than the served one, or the version was
                aborted (e.g. the sender died), or the engine did not reset its cache.
            ManifestError: The session's manifest does not fit ``expected`` (names every tensor).
            ChecksumError: A bucket's bytes differ from what the sender wrote.
            DeadlineExceeded: The version did not arrive or load within ``timeout``.
        """
        timeout = self.config.sync_timeout_s if timeout is None else timeout
        self._ensure_session(self.config.connect_timeout_s)
        if version is not None and self._version is not None and version <= self._version:
            if version == self._version:
                return self._version
            raise VersionError(f"receiver '{self.name}' serves version {self._version}; version {version} goes backwards")
        made = self.control.made()
        target = self.control.wait_version(version, timeout, wait=wait)
        v = target.version
        if v is None or v == self._version:
            return self._version
        deadline = time.monotonic() + timeout
        prev, prev_record = self._version, self._served
        t0 = time.perf_counter()
        self._touched = False
        record = None
        try:
            record = self.declared.version(target.info)
            if target.state == State.COMMITTED and not self._holds_base(record):
                return self._version  # catching up to a version whose base it lacks: wait for a full one
            self.last_metrics = self._load(v, record, Deadline(v, deadline, self.control))
        except BaseException as exc:
            reason, loaded = f"{type(exc).__name__}: {exc}", self._buckets_loaded
            if record is not None:
                reason += self._rollback(record, prev, prev_record, deadline)
                self.member.remember(serving=self._version)  # the previous version again, or none
            _log_apply_failed(self.name, v, self.declared.name, loaded,
                              self.unpacker.plan.bucket_count, time.perf_counter() - t0, reason)
            self._report(v, ok=False, reason=reason)
            raise
        self._version, self._served = v, record
        self.member.remember(serving=v, served=Served(slot=target.slot, info=target.info))
        if self.shadow is not None:
            # a version loaded whole leaves the shadow behind: the next delta is refused
            self.shadow.committed(v if record.delta is not None else None)
        self._report(v, ok=True, metrics=self.last_metrics)
        # coordinator calls of this version, report included
        self.last_metrics = dataclasses.replace(self.last_metrics, calls=self.control.made() - made)
        _log_applied(self.name, v, self.declared.name, self.last_metrics.bytes, self.last_metrics.total_s)
        return v

    def _holds_base(self, record: VersionRecord) -> bool:
        """False for a delta against a version this receiver's shadow does not hold."""
        base = record.delta.base if record.delta is not None else None
        return base is None or (self.shadow is not None and self.shadow.version == base)

    def prefetch(self, version: int | None = None, timeout: float | None = None) -> int | None:
        """Verify ``version`` (None: the newest one on its way) ahead of ``apply()``, e.g. in
        a thread while the engine generates. On shm the checksums are then checked and marked
        for every receiver of the node as the sender writes the buckets, so the barrier only
        loads. Loads nothing and raises nothing about the version: whatever is wrong with it,
        ``apply()`` finds and reports. With an ahead thread running (``receive_ahead``), waits
        for the thread to be done with the version instead of reading it a second time. Returns the version read ahead, or None (nothing
        newer, checksums off, or a transport that keeps nothing to read ahead).

        Args:
            version: The version to read ahead; None: the newest one on its way.
            timeout: Seconds to wait for it; ``sync_timeout_s`` when None.

        Returns:
            The version read ahead, or None.

        Raises:
            ManifestError: The session's manifest does not fit ``expected`` (the session opens
                here when it is not open yet).
        """
        timeout = self.config.sync_timeout_s if timeout is None else timeout
        self._ensure_session(self.config.connect_timeout_s)
        if self._ahead is not None:
            return self._ahead.wait(version, self._version, timeout)  # the thread reads ahead; never a second reader
        if not isinstance(self.transport, Prefetches) or (version is not None and self._version is not None
                                                            and version <= self._version):
            return None
        target = self.control.wait_version(version, timeout, prefetch=True)
        v = target.version
        if v is None or v == self._version:
            return None

        try:
            record = self.declared.version(target.info)
            done = self.transport.prefetch(v, record, Deadline(v, time.monotonic() + timeout, self.control))
        except WeightSyncError:
            return None  # a bad bucket stays unmarked: apply() verifies it and fails the version
        return v if done else None

    def catch_up(self) -> int | None:
        """Load the latest committed version if it is newer than the served one; never waits
        for a version on its way (a restarted receiver calls it to catch up: on shm from the
        kept segment, without the trainer).

        Returns:
            The version served afterwards (None when none).

        Raises:
            WeightSyncError: As ``apply()`` raises when loading that version fails.
        """
        return self.apply(None, wait=False)

    def _load(self, version: int, record: VersionRecord, deadline: Deadline) -> ReceiverMetrics:
        """Receive, verify and load ``version`` whole, then the engine's hooks; its metrics."""
        self._touched = False
        self._buckets_loaded = 0
        t0 = time.perf_counter()
        wait_s = verify_s = load_s = 0.0
        nbytes = peer_verified = 0
        checks = Checks(version)  # host buckets checked at once, device ones in one read at the end
        delta = record.delta
        if delta is not None:
            if self.shadow is None:
                self.shadow = DeltaReceiver(self.unpacker.plan, self.unpacker.manifest, self.name)
            self.shadow.begin(version, delta)  # refuses a delta against a base it does not hold
        rebuilt: list[int] = []  # a delta version's digests of the buckets rebuilt in the shadow
        span = self.transport.span(version, record) if delta is None and isinstance(self.transport, Spans) else None
        kind = self._kind
        t = time.perf_counter()
        for bucket in self.transport.receive(version, record, deadline):
            t1 = time.perf_counter()
            wait_s += t1 - t
            b, buf = bucket.index, bucket.data
            if bucket.digest is not None and kind is not None:
                if bucket.checked:  # by the transport on its way in: recorded for the version's digest
                    checks.add(kind, b, bucket.digest)
                    peer_verified += bucket.checked == "peer"  # another receiver of the node hashed these bytes
                else:
                    checks.add(kind, b, bucket.digest, buf)
            if bucket.generation != self._generation:
                self._generation = bucket.generation
                self.unpacker.forget()  # their buffers went: views of them would keep them mapped
            t2 = time.perf_counter()
            if delta is not None:
                pairs, got = self.shadow.apply(version, delta, b, buf)
                rebuilt.append(got)
            else:
                pairs = self.unpacker.unpack(b, buf, span)
            if pairs:
                if not self._touched:
                    # from here on the model holds a mix of versions until the last bucket
                    self._touched, self._version = True, None
                    self.member.remember(serving=None)
                self.load_weights(pairs)
            nbytes += buf.numel()
            self._buckets_loaded += 1
            _log_bucket(self.name, version, b, buf.numel())
            t = time.perf_counter()
            verify_s += t2 - t1
            load_s += t - t2
        t3 = time.perf_counter()
        # bucket digests, verified here or by a peer on the node; a bad device bucket raises here,
        # before the version is committed
        verified = checks.finish()
        t4 = time.perf_counter()
        verify_s += t4 - t3
        self._finish_load(version)
        t5 = time.perf_counter()
        total = time.perf_counter() - t0
        if delta is not None:
            digest = version_digest("xxh3", rebuilt)  # of the version as rebuilt, equal to the sender's
        else:
            # the whole version's digest, from the bucket digests it verified: equal to the
            # sender's when both hold the same bytes (status() shows both)
            digest = version_digest(kind if len(verified) == self.unpacker.plan.bucket_count else None, verified)
        return ReceiverMetrics(wait_s=wait_s, verify_s=verify_s, load_s=load_s, post_load_s=self._post_s,
                               reset_cache_s=t5 - t4 - self._post_s, total_s=total, bytes=nbytes,
                               peer_verified_buckets=peer_verified, gbps=nbytes / total / 1e9 if total > 0 else 0.0,
                               received_ahead=isinstance(self.transport, ReceivesAhead)
                               and self.transport.received_ahead(version, record),
                               digest=digest)

    def _finish_load(self, version: int | None) -> None:
        """The engine's hooks once a version is loaded whole: post-load, then the cache reset."""
        t = time.perf_counter()
        if self.post_load is not None:
            self.post_load()
        self._post_s = time.perf_counter() - t
        # part of the load, so a failed reset fails (and rolls back) the version: the engine
        # must not answer from KV blocks computed with other weights than the ones committed
        if self.reset_cache is not None and self.reset_cache() is False:
            raise VersionError(f"receiver '{self.name}': the engine did not reset its cache after loading "
                               f"version {version} (reset_cache returned False: requests still running?)")

    def _abort_load(self) -> str:
        if self.abort_load is None:
            return ""
        try:
            self.abort_load()
        except Exception as exc:  # the rollback below reloads every tensor anyway
            return f"; abort_load failed ({type(exc).__name__}: {exc})"
        return ""

    def _rollback(self, record: VersionRecord, prev: int | None, prev_record: VersionRecord | None,
                  deadline: float) -> str:
        """After the version of ``record`` failed: load the version served before it again where
        a bucket of the failed one reached the model; a suffix for the report."""
        touched = self._touched
        why = self._abort_load() if touched else ""
        if record.delta is not None:
            return why + self._undo_delta(prev, touched)
        if not touched:
            return why
        # a delta version's bytes at the transport are encoded buckets, not the version
        if (prev is None or prev_record is None or prev_record.delta is not None or not self.config.keep_previous
                or not isinstance(self.transport, Replays) or not self.transport.can_replay(prev, prev_record)):
            return why + f"; serves no version until the next sync (previous version {prev} is not at hand)"
        try:
            # a complete version already served: its later fate does not matter (no abort check)
            self._load(prev, prev_record, Deadline(prev, max(deadline, time.monotonic() + self.config.sync_timeout_s)))
        except Exception as exc:  # the engine's own hooks raise what they raise; the version still fails
            return why + f"; rollback to version {prev} failed too ({type(exc).__name__}: {exc}); serves no version"
        self._version = prev
        return why + f"; rolled back to version {prev}"

    def _undo_delta(self, prev: int | None, touched: bool) -> str:
        """A failed delta version: the shadow's undo records put it back to ``prev``, and what the
        version loaded is loaded again from there."""
        undone = self.shadow.failed(prev) if self.shadow is not None else None
        if undone is None:
            return ""  # refused before the shadow changed
        try:
            if touched:
                for pairs in undone.reload:
                    self.load_weights(pairs)
                if undone.version is not None:
                    self._finish_load(undone.version)
        except Exception as exc:  # the engine's own hooks raise what they raise; the version still fails
            self.shadow.version = None
            self._version = None
            return f"; rollback to version {prev} failed too ({type(exc).__name__}: {exc}); serves no version"
        if touched or self.shadow.diverged:
            # a diverged shadow is no base even when nothing of the version reached the model:
            # serving prev without it, this receiver would be sent deltas it must refuse
            self._version = undone.version
            return undone.why
        return ""

    def _report(self, version: int, ok: bool, reason: str = "", metrics: ReceiverMetrics | None = None) -> None:
        try:
            self.control.report(version, ok, serving=self._version, reason=reason, metrics=metrics)
        except WeightSyncError:
            if ok:
                raise


# -- receive_ahead ----------------------------------------------------------------------------

WAIT_S = 2.0  # one wait at the coordinator; also how long close() may wait for the thread


class AheadThread:
    """A receiver's thread (config ``receive_ahead``) that takes each version as soon as the
    sender makes it readable, while the engine still serves the version before, so that
    ``apply()`` at the barrier only loads, runs the post-load hook and resets the cache.

    What "takes" means is the transport's (ReceivesAhead.prefetch): broadcast receives a version
    sent in stage() into its ahead copy, shm verifies the version's segment; on a device on a
    stream of the copy's own, not on this thread's current one, which on CUDA is the default
    stream the engine generates on. The thread never touches the engine: a version that fails
    on its way in fails in ``apply()``, which reports it, naming this receiver, and the engine
    keeps serving what it served (all-or-nothing, as at the barrier).

    The thread tells the coordinator it is there (``wait_version(ahead=True)``): a broadcast
    sender sends a version ahead only when every live receiver has one, since a collective
    needs every member in it."""

    def __init__(self, name: str, config: SyncConfig, control: ControlPlane, transport: ReceivesAhead,
                 declared: Transport):
        self.name, self.config, self.control, self.transport, self.declared = name, config, control, transport, declared
        self.taken: int | None = None  # the newest version taken (or tried) ahead
        self._outcome: tuple[int, bool] | None = None  # (version, it came in whole and verified)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weightsync-ahead-{name}", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, name: str, config: SyncConfig, control: ControlPlane, transport: ReceiverTransport,
              declared: Transport) -> AheadThread | None:
        """The thread, where config and transport allow it (None: versions come at the barrier).

        Raises:
            CapacityError: ``receive_ahead: on`` and the ahead copy does not fit; the receiver
                tells the coordinator it rejects the session, so every version names it.
        """
        if config.receive_ahead == "off" or not isinstance(transport, ReceivesAhead):
            return None
        try:
            nbytes = transport.open_ahead()
        except CapacityError as exc:
            if config.receive_ahead == "on":
                control.verdict(False, why=str(exc))
                raise
            log.info("weightsync %s: receive_ahead auto: versions at the barrier (%s)", name, exc)
            return None
        return None if nbytes is None else cls(name, config, control, transport, declared)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                target = self.control.wait_version(None, WAIT_S, prefetch=True, after=self.taken, ahead=True)
            except DeadlineExceeded:
                continue  # nothing new yet
            except Exception:  # left the session, the coordinator restarts: the thread must live on,
                # since the coordinator counts it ready and a collective would wait for it
                if self._stop.wait(0.2):
                    return
                continue
            v = target.version
            if v is None or self._stop.is_set():
                continue
            self.taken = v
            ok = False
            try:
                record = self.declared.version(target.info)
                ok = self.transport.prefetch(v, record, Deadline(v, time.monotonic() + self.config.sync_timeout_s,
                                                                 self.control))
            except Exception as exc:  # kept by the transport for apply(), which reports it
                log.info("weightsync %s: version %d failed on its way in ahead: %s: %s",
                         self.name, v, type(exc).__name__, exc)
            with self._cond:
                self._outcome = (v, ok)
                self._cond.notify_all()

    def wait(self, version: int | None, served: int | None, timeout: float) -> int | None:
        """``receiver.prefetch()`` with a thread running: wait until the thread is done with
        ``version`` (None: with one newer than ``served``); that version if it came in whole,
        else None. Never a second reader beside the thread (a collective has one)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = self._outcome
                if got is not None and (got[0] >= version if version is not None else served is None or got[0] > served):
                    return got[0] if got[1] and (version is None or got[0] == version) else None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S + 1.0)


def _log_applied(party: str, version: int, transport: str | None, nbytes: int, seconds: float) -> None:
    log.info("receiver %s v%d committed %s %s %.3fs", party, version, transport, size_text(nbytes), seconds)


def _log_apply_failed(party: str, version: int, transport: str | None, buckets: int, total: int, seconds: float,
                      why: str) -> None:
    log.warning("receiver %s v%d failed %s after %d/%d buckets %.3fs: %s", party, version, transport, buckets, total,
                seconds, why)


def _log_bucket(party: str, version: int, index: int, nbytes: int) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s v%d bucket %d %s", party, version, index, size_text(nbytes))
