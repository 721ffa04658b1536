"""Internal. Rollout side. A receiver serves exactly one complete version at a time, or none.

One version, end to end:  apply(v)
  -> coordinator.session(): manifest, checked against the model before any byte moves
  -> coordinator.wait_version(v): where the bytes are
  -> transport.receive(): bucket by bucket -> verify checksum -> the version's loader
     (delta/strategy.py: views of the buffers, or rebuilt in delta sync's shadow) -> load_weights
  -> post_load() once -> reset_cache() -> coordinator.report(ok) ... now serving v
On a failure after the first bucket was loaded, the loader loads the previous version again
where it can (from the transport, or the shadow's undo records), else the receiver serves
nothing until it catches up.
With receive_ahead, an ahead thread (receive_ahead.py) takes each version before apply() does.

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

import torch

from .config import SyncConfig
from .coordinator.client import ControlPlane, Coordinator, Member
from .coordinator.state import State
from .delta.strategy import Engine, Loaders
from .digest import Checks
from .errors import ManifestError, VersionError, WeightSyncError
from .manifest import Expected, Manifest, check_manifest, size_text
from .packing import Unpacker
from .receive_ahead import AheadThread, Receiving
from .records import ReceiverMetrics, Served
from .targets import LoadWeights
from .transports.base import ReceiverTransport, TransportContext, VersionRecord
from .transports.selection import receiver_class

log = logging.getLogger("weightsync")


class WeightReceiver:
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
        self.unpacker: Unpacker | None = None
        self._version: int | None = None
        self._touched = False  # a bucket of the version being applied reached the model
        self._buckets_loaded = 0  # of the version being applied, for its log line
        self._served: VersionRecord | None = None  # where the served version's bytes are, for rollback
        self._loaders: Loaders | None = None  # full, or through delta sync's shadow (delta/strategy.py)
        self._session_lock = threading.Lock()  # prefetch() may run in a thread beside apply()
        self._ahead: AheadThread | None = None  # receive_ahead: takes versions before the barrier
        self.last_metrics: ReceiverMetrics | None = None  # of the last version it committed
        self.open()

    # -- who it is, its session and its calls to the coordinator: its member's -------------

    @property
    def coordinator(self) -> Coordinator:
        return self.member.coordinator

    @property
    def name(self) -> str:
        return self.member.name

    @property
    def rank(self) -> int:
        return self.member.rank

    @property
    def config(self) -> SyncConfig:
        return self.member.config

    @property
    def device(self) -> torch.device:
        return self.member.device

    @property
    def session(self) -> str | None:
        return self.member.session

    @property
    def party_id(self) -> int | None:
        return self.member.party_id

    @property
    def control(self) -> ControlPlane:
        return self.member.control

    def open(self) -> WeightReceiver:
        """Register with the coordinator and start the heartbeat. Idempotent; the constructor
        calls it, so users never need to.

        Returns:
            This receiver.

        Raises:
            WeightSyncError: The coordinator is unreachable or refused the registration.
        """
        self.member.open()
        return self

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

    def __enter__(self) -> WeightReceiver:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        ctx = TransportContext.for_party(self.member, manifest, session.digest)
        transport = receiver_class(session.transport)(ctx, session.info)
        self.transport, self.unpacker = transport, Unpacker(ctx.plan, manifest)
        self._loaders = Loaders(self.unpacker, self.name)
        try:
            self._ahead = AheadThread.start(Receiving(self.name, self.config, self.control, transport,
                                                      lambda: self._version, self._raise_if_aborted))
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
        prev, prev_info = self._version, self._served
        t0 = time.perf_counter()
        self._touched = False
        info = None
        try:
            info = self.transport.parse_version(target.info)
            if target.state == State.COMMITTED and not self._loaders.holds_base(info):
                return self._version  # catching up to a version whose base it lacks: wait for a full one
            self.last_metrics = self._load(v, info, deadline)
        except BaseException as exc:
            reason, loaded = f"{type(exc).__name__}: {exc}", self._buckets_loaded
            if info is not None:
                reason += self._rollback(info, prev, prev_info, deadline)
            _log_apply_failed(self.name, v, self.transport.name, loaded,
                                self.unpacker.plan.bucket_count, time.perf_counter() - t0, reason)
            self._report(v, ok=False, reason=reason)
            raise
        self._version, self._served = v, info
        self.member.remember(serving=v, served=Served(slot=target.slot, info=target.info))
        self._loaders.committed(v, info)
        self._report(v, ok=True, metrics=self.last_metrics)
        # coordinator calls of this version, report included
        self.last_metrics = dataclasses.replace(self.last_metrics, calls=self.control.made() - made)
        _log_applied(self.name, v, self.transport.name, self.last_metrics.bytes, self.last_metrics.total_s)
        return v

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
            return self._ahead.wait(version, timeout)  # the thread reads ahead; never a second reader
        if self.transport.digest_kind is None or (version is not None and self._version is not None
                                           and version <= self._version):
            return None
        target = self.control.wait_version(version, timeout, prefetch=True)
        v = target.version
        if v is None or v == self._version:
            return None

        try:
            info = self.transport.parse_version(target.info)
            done = self.transport.prefetch(v, info, time.monotonic() + timeout, lambda: self._raise_if_aborted(v))
        except WeightSyncError:
            return None  # a bad bucket stays unmarked: apply() verifies it and fails the version
        return v if done else None

    def _raise_if_aborted(self, version: int) -> None:
        state = self.control.state(version)
        if state.state == State.ABORTED:
            raise VersionError(f"version {version} was aborted: {state.reason}")

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

    def _load(self, version: int, info: VersionRecord, deadline: float, replay: bool = False) -> ReceiverMetrics:
        def check() -> None:
            if not replay:  # a replayed version is complete; its later fate does not matter
                self._raise_if_aborted(version)

        self._touched = False
        self._buckets_loaded = 0
        t0 = time.perf_counter()
        wait_s = verify_s = load_s = 0.0
        nbytes = peer_verified = 0
        checks = Checks(version)  # host buckets checked at once, device ones in one read at the end
        loader = self._loaders.of(info)
        loader.begin(version, info, self.transport)
        t = time.perf_counter()
        for b, buf, expected in self.transport.receive(version, info, deadline, check):
            t1 = time.perf_counter()
            wait_s += t1 - t
            if not self.transport.verify_bucket(version, info, b, buf, expected, checks) and expected is not None:
                peer_verified += 1  # another receiver on the node hashed these very bytes
            t2 = time.perf_counter()
            pairs = loader.unpack(version, info, b, buf)
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
        if self.post_load is not None:
            self.post_load()
        t5 = time.perf_counter()
        # part of the load, so a failed reset fails (and rolls back) the version: the engine
        # must not answer from KV blocks computed with other weights than the ones committed
        if self.reset_cache is not None and self.reset_cache() is False:
            raise VersionError(f"receiver '{self.name}': the engine did not reset its cache after loading "
                               f"version {version} (reset_cache returned False: requests still running?)")
        reset_s = time.perf_counter() - t5
        post_s = t5 - t4
        total = time.perf_counter() - t0
        kind = self.transport.digest_kind if len(verified) == self.unpacker.plan.bucket_count else None
        return ReceiverMetrics(wait_s=wait_s, verify_s=verify_s, load_s=load_s, post_load_s=post_s,
                               reset_cache_s=reset_s, total_s=total, bytes=nbytes, peer_verified_buckets=peer_verified,
                               gbps=nbytes / total / 1e9 if total > 0 else 0.0,
                               received_ahead=self.transport.received_ahead(version, info),
                               # the whole version's digest, from the bucket digests it verified: equal
                               # to the sender's when both hold the same bytes (status() shows both)
                               digest=loader.digest(kind, verified))

    def _abort_load(self) -> str:
        if self.abort_load is None:
            return ""
        try:
            self.abort_load()
        except Exception as exc:  # the rollback below reloads every tensor anyway
            return f"; abort_load failed ({type(exc).__name__}: {exc})"
        return ""

    def _rollback(self, info: VersionRecord, prev: int | None, prev_info: VersionRecord | None,
                  deadline: float) -> str:
        # the failed version's loader knows where the previous one can come back from (the
        # transport's kept copy, or the shadow's undo records); the engine's hooks stay here
        touched = self._touched
        why = self._abort_load() if touched else ""

        def finish() -> None:
            if self.post_load is not None:
                self.post_load()
            if self.reset_cache is not None and self.reset_cache() is False:
                raise VersionError("the engine did not reset its cache")

        engine = Engine(
            load=self.load_weights, finish=finish,
            replay=lambda v, i: self._load(v, i, max(deadline, time.monotonic() + self.config.sync_timeout_s),
                                           replay=True),
            can_replay=lambda v, i: self.config.keep_previous and self.transport.can_replay(v, i))
        more, self._version = self._loaders.of(info).rollback(prev, prev_info, touched, self._version, engine)
        self.member.remember(serving=self._version)  # the previous version again, or none
        return why + more

    def _report(self, version: int, ok: bool, reason: str = "", metrics: ReceiverMetrics | None = None) -> None:
        try:
            self.control.report(version, ok, serving=self._version, reason=reason, metrics=metrics)
        except WeightSyncError:
            if ok:
                raise


def _log_applied(party: str, version: int, transport: str | None, nbytes: int, seconds: float) -> None:
    log.info("receiver %s v%d committed %s %s %.3fs", party, version, transport, size_text(nbytes), seconds)


def _log_apply_failed(party: str, version: int, transport: str | None, buckets: int, total: int, seconds: float,
                      why: str) -> None:
    log.warning("receiver %s v%d failed %s after %d/%d buckets %.3fs: %s", party, version, transport, buckets, total,
                seconds, why)


def _log_bucket(party: str, version: int, index: int, nbytes: int) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s v%d bucket %d %s", party, version, index, size_text(nbytes))
