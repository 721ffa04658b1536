"""Internal. What a party or a driver reaches the coordinator through: the handle that creates or
reaches the actor and calls it (:class:`Coordinator`), over Ray or the actor's control channel
(:class:`Link`, this end of it); one party's typed view of it (:class:`ControlPlane`), where
every control-plane operation is a method; and a party's membership of the session
(:class:`Member`, held by WeightSender and WeightReceiver): its registration, heartbeat and
rejoin, the other half of the control plane's retry.

The actor itself (``weightsync.coordinator.actor``) owns the session and the version state machine
(``weightsync.coordinator.actor``). The handle is what parties and drivers hold; it is picklable,
so a driver creates it and hands it to its workers.

A misspelled operation or argument fails where it is written (an AttributeError or TypeError in
the caller, caught by any test that runs the line), not as a ``ProtocolError`` from the actor at
run time. Each call sends one request record of :mod:`weightsync.records` and gets back its
reply record, decoded strictly, so a reply that changed shape fails loudly.

Calls go through the member: a coordinator that restarted answers ``SessionLost``; the member
registers again, telling the coordinator what its owner pushed to it (:meth:`Member.remember`),
and the call is retried once. The sender, the receivers and every transport reach the
coordinator only through :class:`ControlPlane`, so rejoin works the same everywhere.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from .. import errors, records
from ..config import SyncConfig
from ..device import describe, resolve
from ..errors import DeadlineExceeded, ProtocolError, SessionLost, SyncFailed, WeightSyncError
from ..records import FRAME_HEADER, HELLO, MAX_MESSAGE_BYTES, Publication, Served, SessionInfo, Target, VersionState
from .actor import CoordinatorActor
from .status_text import format_status

__all__ = ["ControlPlane", "Coordinator", "Member", "Publication", "SessionInfo", "Target", "VersionState"]

_ERRORS = {n: c for n, c in vars(errors).items() if isinstance(c, type) and issubclass(c, WeightSyncError)}


def _raise_remote(failure: records.Failure) -> None:
    if failure.kind == "SyncFailed" and failure.version is not None:
        raise SyncFailed(failure.version, failure.failed or {}, failure.committed)
    raise _ERRORS.get(failure.kind, WeightSyncError)(failure.error)


# -- this end of the control channel (the coordinator's: actor.Server) ------------------------

# a port nobody answers on (a firewall that drops packets) must not cost a call its whole
# deadline; a live actor's kernel completes the handshake without waiting for its loop
CONNECT_S = 5.0


class Broken(Exception):
    """The connection failed (reset, closed mid-reply): the actor is gone or restarted; the
    call goes through Ray instead, which reaches a restarted actor."""


class Unreachable(Broken):
    """No connection could be opened (refused, or no answer within ``CONNECT_S``)."""


class Link:
    """Connections to one coordinator's control channel at ``address``, one per calling thread
    (a long poll blocks only its own): a frame is the payload's length in ``FRAME_HEADER``
    big-endian bytes, then the payload; the reply comes back framed the same way. Each
    connection opens with the hello frame that proves ``token`` (``None``: none, for a peer that
    asks for none), sent with the first call's frame: no round trip of its own."""

    def __init__(self, address: tuple[str, int], token: str | None = None):
        self.address = address
        self._hello = b"" if token is None else _frame(HELLO + token.encode())
        self._local = threading.local()
        self._pid = os.getpid()

    def call(self, payload: bytes, deadline: float) -> bytes:
        """The reply to ``payload``.

        Raises:
            Unreachable: No connection could be opened.
            Broken: The connection failed; this thread's connection is dropped.
            TimeoutError: No reply by ``deadline`` (time.monotonic()); the connection is dropped,
                so a late reply never answers the next call.
        """
        if os.getpid() != self._pid:
            # a forked child holds its parent's connections: frames of both would interleave on them
            raise Broken("the link was opened by the parent process")
        sock, fresh = self._connection(deadline)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            sock.sendall((self._hello if fresh else b"") + _frame(payload))
            size = int.from_bytes(_read(sock, FRAME_HEADER, deadline), "big")
            if size > MAX_MESSAGE_BYTES:
                raise Broken(f"a reply frame of {size} bytes")
            return _read(sock, size, deadline)
        except TimeoutError:
            self.drop()
            raise
        except (OSError, Broken) as exc:
            self.drop()
            raise Broken(str(exc)) from None

    def _connection(self, deadline: float) -> tuple[socket.socket, bool]:
        """This thread's connection, and whether it was opened now."""
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            return sock, False
        try:
            timeout = min(CONNECT_S, max(deadline - time.monotonic(), 1e-3))
            sock = socket.create_connection(self.address, timeout=timeout)
        except OSError as exc:  # a connect timeout included: nobody answers there
            raise Unreachable(f"cannot connect to {self.address[0]}:{self.address[1]}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._local.sock = sock
        return sock, True

    def drop(self) -> None:
        """Close this thread's connection (the next call opens a new one)."""
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            sock.close()


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(FRAME_HEADER, "big") + payload


def _read(sock: socket.socket, size: int, deadline: float) -> bytes:
    out = bytearray(size)
    view, got = memoryview(out), 0
    while got < size:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        n = sock.recv_into(view[got:])
        if n == 0:
            raise Broken("the coordinator closed the connection")
        got += n
    return bytes(out)


# -- the handle ---------------------------------------------------------------------------------


class Coordinator:
    """Client handle of the coordinator actor; picklable, so it can be handed to workers.

    ``Coordinator.create()`` starts the actor in the driver; workers receive the handle (or
    call ``Coordinator.connect(name, token)``). Every call presents the session token; with
    ``control_channel: socket`` it goes over the coordinator's control channel
    (coordinator/actor.py, ``Server``), whose address the handle learns through Ray at its first call.
    Build one with ``create()`` or ``connect()``, not with the constructor.

    Args:
        actor: The Ray actor handle of the coordinator.
        name: Its Ray actor name.
        namespace: Its Ray namespace ("" for the job's own).
        token: The session token every call presents.
        config: The job's configuration; parties use it unless given their own.
    """

    def __init__(self, actor: Any, name: str, namespace: str, token: str, config: SyncConfig):
        self.actor, self.name, self.namespace, self.token, self.config = actor, name, namespace, token, config
        # False once the coordinator refused the channel, or its port could not be reached:
        # then every call goes through Ray
        self._direct = config.control_channel == "socket"
        self._link: Link | None = None

    def __getstate__(self) -> dict[str, Any]:
        # the link's sockets belong to the threads of the process that opened them; a worker
        # learns the address itself (a restarted coordinator's, where it restarted meanwhile)
        return {k: v for k, v in self.__dict__.items() if k != "_link"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a handle made by another revision (bench --against) may lack what this one adds: Ray then
        self.__dict__.update({"_direct": False, **state, "_link": None})

    @classmethod
    def create(cls, config: SyncConfig | dict | None = None, *, name: str | None = None,
               detached: bool = False,
               token: str | None = None, actor_options: dict | None = None) -> Coordinator:
        """Start the coordinator actor (in the driver) and return its handle.

        Args:
            config: A SyncConfig, or a mapping of its keys; ``WEIGHTSYNC_<KEY>`` environment
                variables apply on top of a mapping (or of the defaults, when None).
            name: The actor's name; defaults to ``config.coordinator_name``.
            detached: Keep the actor alive after the driver exits.
            token: The session token; a random 128-bit one when None.
            actor_options: Extra Ray actor options, applied last.

        Returns:
            The handle, once the actor answered its first call.

        Raises:
            WeightSyncError: A coordinator of that name already exists in the namespace.
            ConfigError: A config key is unknown or its value impossible.
            DeadlineExceeded: The actor did not answer within ``connect_timeout_s``.
        """
        cfg = config if isinstance(config, SyncConfig) else SyncConfig.load(config)
        name = name or cfg.coordinator_name
        token = token or secrets.token_hex(16)
        # Ray restarts a crashed coordinator; parties then re-register (ControlPlane below) and the
        # next version goes through. Calls in flight during the restart are retried.
        options = {"name": name, "max_concurrency": 1000, "num_cpus": 0, "max_restarts": -1, "max_task_retries": -1}
        if cfg.namespace:
            options["namespace"] = cfg.namespace
        if detached:
            options["lifetime"] = "detached"
        options.update(actor_options or {})
        actor_cls = ray.remote(CoordinatorActor)
        try:
            actor = actor_cls.options(**options).remote(cfg.to_dict(), token)
        except ValueError as exc:  # Ray: name already taken
            raise WeightSyncError(f"a coordinator named {name!r} already exists in this Ray namespace: {exc}") from None
        client = cls(actor, name, cfg.namespace, token, cfg)
        client.call(records.GetStatus(), rpc_timeout=cfg.connect_timeout_s)
        return client

    @classmethod
    def connect(cls, name: str, token: str, config: SyncConfig | dict | None = None) -> Coordinator:
        """Reach a running coordinator by name, e.g. from a process that did not get the handle.

        Args:
            name: The coordinator's Ray actor name.
            token: The session token it was created with.
            config: The job's configuration (its ``namespace`` is where the actor is looked up).

        Returns:
            A handle to the running actor.

        Raises:
            WeightSyncError: No coordinator of that name runs in the namespace.
            ConfigError: A config key is unknown or its value impossible.
        """
        cfg = config if isinstance(config, SyncConfig) else SyncConfig.load(config)
        try:
            actor = ray.get_actor(name, namespace=cfg.namespace or None)
        except ValueError:
            raise WeightSyncError(f"no coordinator named {name!r} is running") from None
        return cls(actor, name, cfg.namespace, token, cfg)

    def call(self, request: records.Request, *, rpc_timeout: float | None = None) -> Any:
        """One control-plane call. Parties use the typed ``ControlPlane`` below;
        this is its transport (and the way to send a malformed call on purpose in tests).

        Args:
            request: The operation's request record (weightsync/records.py).
            rpc_timeout: Seconds to wait for the answer beyond the call's own ``timeout``
                field; ``connect_timeout_s`` when None.

        Returns:
            The operation's reply record (``request.reply``).

        Raises:
            DeadlineExceeded: The coordinator did not answer in time.
            ProtocolError: The answer is not the request's reply record.
            WeightSyncError: The coordinator is unreachable, or the call failed there (the
                coordinator's own error class is raised, e.g. SyncFailed, VersionError).
        """
        payload = records.encode({"op": type(request).__name__, "token": self.token, "args": request.to_wire()})
        # the call itself may wait up to its timeout field; allow it that plus slack
        limit = ((rpc_timeout if rpc_timeout is not None else self.config.connect_timeout_s)
                 + float(getattr(request, "timeout", 0) or 0) + 5.0)
        raw = None
        if self._direct and not isinstance(request, records.Channel):
            raw = self._over_channel(request, payload, limit, rpc_timeout)
        if raw is None:
            try:
                raw = ray.get(self.actor.rpc.remote(payload), timeout=limit)
            except ray.exceptions.GetTimeoutError:
                raise DeadlineExceeded(self._late(request, limit)) from None
            except ray.exceptions.RayActorError as exc:
                raise WeightSyncError(f"coordinator '{self.name}' is unreachable (actor died?): {exc}") from None
        reply = records.decode(raw)
        if not isinstance(reply, dict):
            raise ProtocolError(f"control: the reply to {type(request).__name__} is not a map")
        if reply.get("ok") is not True:
            _raise_remote(records.Failure.from_wire({k: v for k, v in reply.items() if k != "ok"}))
        want = request.reply
        if reply.get("type") != want.__name__:
            raise ProtocolError(f"control: {type(request).__name__} was answered with {reply.get('type')!r}, "
                                f"not {want.__name__} (the two ends run different weightsync versions?)")
        return want.from_wire(reply.get("result"))

    def _late(self, request: records.Request, limit: float) -> str:
        return f"coordinator '{self.name}' did not answer {request.op!r} within {limit:.1f}s"

    def _over_channel(self, request: records.Request, payload: bytes, limit: float,
                      rpc_timeout: float | None) -> bytes | None:
        """The reply over the control channel; None: send the call through Ray."""
        link = self._link
        fresh = link is None
        if link is None:
            try:
                address = self.call(records.Channel(), rpc_timeout=rpc_timeout)
            except DeadlineExceeded:  # slow or restarting: this call goes through Ray, the next one asks again
                return None
            except WeightSyncError:  # refused (an older coordinator, control_channel: ray), or gone for good
                self._direct = False
                return None
            link = self._link = Link((address.host, address.port), self.token)
        try:
            return link.call(payload, time.monotonic() + limit)
        except TimeoutError:
            raise DeadlineExceeded(self._late(request, limit)) from None
        except Broken as exc:
            # the actor died or restarted: this call goes through Ray, which waits for the new
            # incarnation (it answers SessionLost where it lost the party), and the next call
            # learns the new address. A port never reached since it was learned is closed to
            # this node (a firewall): Ray from now on, not a failed connect before every call.
            if self._link is link:
                self._link = None
            if fresh and isinstance(exc, Unreachable):
                self._direct = False
            return None

    def register(self, *, role: str, name: str, rank: int, host: str, os_pid: int, node_id: str = "",
                 device: records.Device | dict | None = None, last_version: int | None = None,
                 serving: int | None = None, served: Served | dict | None = None,
                 rpc_timeout: float | None = None) -> records.Registered:
        """Join the session (senders and receivers do it when they are built).

        Args:
            role: "sender" or "receiver".
            name: The party's name, unique in the session.
            rank: Its rank (trainer rank, or rollout worker rank).
            host: Its host address.
            os_pid: Its process id.
            node_id: Its Ray node id ("" without Ray).
            device: Where it runs (a ``Device`` record, or the map ``weightsync.device.describe`` gives).
            last_version: For a sender that outlived a coordinator restart: its last version.
            serving: For such a receiver: the version it serves.
            served: For such a receiver: where that version's bytes are (a ``Served`` record or its map).
            rpc_timeout: As for ``call()``.

        Returns:
            The party's id (``party``), the ``session`` and the coordinator's ``config``.
        """
        if isinstance(device, dict):
            device = records.Device(**device)
        if isinstance(served, dict):
            served = Served(**served)
        request = records.Register(role=role, name=name, rank=rank, host=host, os_pid=os_pid, node_id=node_id,
                                   device=device, last_version=last_version, serving=serving, served=served)
        return self.call(request, rpc_timeout=rpc_timeout)

    def status(self) -> records.Status:
        """The session as the coordinator sees it.

        Returns:
            The session id, the transport and why it was chosen, ``latest_committed``, the
            parties, the last 20 versions (state, reason, participants, phases, digests),
            resources held and the config (``format_status()`` prints it; ``as_dict()`` is
            the plain map, e.g. for JSON).
        """
        return self.call(records.GetStatus())

    def metrics(self, version: int) -> records.Metrics:
        """One version as status() shows it.

        Args:
            version: The version to look up.

        Returns:
            Its state, reason, participants, phases, each receiver's measurements and info.
        """
        return self.call(records.GetMetrics(version=version))

    def format_status(self) -> str:
        """``status()`` as text for a terminal or a log.

        Returns:
            One block of lines: parties, transport, versions.
        """
        return format_status(self.status())

    def check_batch(self, batch_version: int, step: int, max_staleness: int | None = None) -> int:
        """Check a rollout batch's weight version against the staleness bound.

        Args:
            batch_version: The weight version the batch was generated with.
            step: The training step that would consume it.
            max_staleness: The bound; the config's ``max_staleness`` when None.

        Returns:
            The lag ``step - batch_version``.

        Raises:
            StalenessError: The lag is negative or over the bound.
        """
        return self.call(records.CheckBatch(batch_version=batch_version, step=step, max_staleness=max_staleness)).lag

    def shutdown(self) -> None:
        """Kill the coordinator actor; nothing happens if it is already gone."""
        try:
            ray.kill(self.actor)
        except Exception:  # already gone
            pass


# The handle crosses processes by pickle (a driver hands it to its parties), and those may run
# another revision of this package (``weightsync bench --against REV``): it pickles under its
# public name, which stays put when the internal modules move.
Coordinator.__module__ = "weightsync"


class ControlPlane:
    """``party()`` gives the party's current id; ``rejoin(stale_id)`` registers again after
    a coordinator restart (None: SessionLost reaches the caller)."""

    def __init__(self, coordinator: Coordinator, party: Callable[[], int],
                 rejoin: Callable[[int], None] | None = None, _made: threading.local | None = None):
        self.coordinator, self._party, self._rejoin = coordinator, party, rejoin
        # calls made, per thread: a version's own count (its metrics show it) is the calls its
        # thread made, whatever the heartbeat or an ahead thread did meanwhile
        self._made = threading.local() if _made is None else _made
        self._barriers: dict[int, records.Participants] = {}

    def without_rejoin(self) -> ControlPlane:
        """For calls made while rejoining: a second SessionLost then reaches the caller."""
        return ControlPlane(self.coordinator, self._party, _made=self._made)

    def made(self) -> int:
        """Calls the calling thread made through this party so far (a retry counts again)."""
        return getattr(self._made, "n", 0)

    def _count(self) -> None:
        self._made.n = self.made() + 1

    def _send(self, request: Any, rpc_timeout: float | None = None) -> Any:
        """``request``'s reply; its ``party`` field is this party's id, replaced by the new
        one when the call is retried after a rejoin."""
        self._count()
        try:
            return self.coordinator.call(request, rpc_timeout=rpc_timeout)
        except SessionLost:
            if self._rejoin is None:
                raise
            self._rejoin(request.party)
            self._count()
            return self.coordinator.call(dataclasses.replace(request, party=self._party()), rpc_timeout=rpc_timeout)

    # -- every party ---------------------------------------------------------------------

    def heartbeat(self, rpc_timeout: float) -> None:
        self._send(records.Heartbeat(party=self._party()), rpc_timeout=rpc_timeout)

    def resource(self, kind: str, delta: int) -> None:
        """Open (+1) / close (-1) of a segment or handle, so leaks show in status()."""
        self._send(records.Resource(party=self._party(), kind=kind, delta=delta))

    def leave(self) -> None:
        self._send(records.Leave(party=self._party()))

    # -- sender --------------------------------------------------------------------------

    def receivers(self, count: int, timeout: float) -> list[records.Placement]:
        """Wait until ``count`` receivers are registered; returns them by rank."""
        return self._send(records.Receivers(party=self._party(), count=count, timeout=timeout)).receivers

    def publish(self, publication: Publication) -> None:
        self._send(records.Publish(party=self._party(), publication=publication))

    def begin_stage(self, version: int) -> int:
        """Open ``version``; returns the storage slot it takes."""
        return self._send(records.BeginStage(party=self._party(), version=version)).slot

    def stage_info(self, version: int, info: records.WireMap, readable: bool = False) -> None:
        """More of ``version``'s info; ``readable``: receivers of a pipelined transport may
        start reading it (the sender is still writing)."""
        self._send(records.StageInfo(party=self._party(), version=version, info=info, readable=readable))

    def staged(self, version: int, info: records.WireMap, stage_s: float) -> None:
        self._send(records.Staged(party=self._party(), version=version, info=info, stage_s=stage_s))

    def begin_part(self, version: int, timeout: float) -> records.Part:
        """A sending rank other than 0: wait until rank 0 opened ``version``; where its rows go."""
        return self._send(records.BeginPart(party=self._party(), version=version, timeout=timeout))

    def part_staged(self, version: int, info: records.WireMap) -> None:
        """A sending rank other than 0 wrote its rows of ``version``; ``info``: its part of the record."""
        self._send(records.PartStaged(party=self._party(), version=version, info=info))

    def wait_parts(self, version: int, count: int, timeout: float) -> list[records.WireMap]:
        """Sender rank 0: the parts of the ``count`` other sending ranks, once all are written."""
        return self._send(records.WaitParts(party=self._party(), version=version, count=count,
                                            timeout=timeout)).parts

    def abort(self, version: int, reason: str) -> None:
        self._send(records.Abort(party=self._party(), version=version, reason=reason))

    def begin_sync(self, version: int) -> records.Participants:
        """The barrier; returns the participants of ``version``, kept for :meth:`barrier`."""
        reply = self._send(records.BeginSync(party=self._party(), version=version))
        self._barriers = {v: r for v, r in self._barriers.items() if v > version - 4}
        self._barriers[version] = reply
        return reply

    def barrier(self, version: int) -> records.Participants | None:
        """What this party's begin_sync of ``version`` answered (None: it made none): the
        transport learns the participants once per sync, without a call of its own."""
        return self._barriers.get(version)

    def wait_outcome(self, version: int, timeout: float, info: records.WireMap | None = None) -> records.Metrics:
        """The committed version's metrics; raises SyncFailed naming each failed party.
        ``info``: more of the version's info first (as stage_info), in the same call."""
        return self._send(records.WaitOutcome(party=self._party(), version=version, timeout=timeout, info=info))

    # -- receiver ------------------------------------------------------------------------

    def session(self, timeout: float) -> SessionInfo:
        return self._send(records.Session(party=self._party(), timeout=timeout))

    def verdict(self, accepted: bool, why: str = "") -> None:
        """The manifest check's outcome, before any byte moves."""
        self._send(records.Verdict(party=self._party(), accepted=accepted, why=why))

    def wait_version(self, version: int | None, timeout: float, wait: bool = True,
                     prefetch: bool = False, after: int | None = None, ahead: bool = False) -> Target:
        """``after``: only a version newer than it (and than the one served); ``ahead``: the
        caller is a receiver's ahead thread, ready to take versions before their barrier."""
        return self._send(records.WaitVersion(party=self._party(), version=version, timeout=timeout, wait=wait,
                                              prefetch=prefetch, after=after if ahead else None, ahead=ahead))

    def state(self, version: int) -> VersionState:
        return self._send(records.GetState(party=self._party(), version=version))

    def report(self, version: int, ok: bool, serving: int | None, reason: str = "",
               metrics: records.ReceiverMetrics | None = None) -> None:
        self._send(records.Report(party=self._party(), version=version, ok=ok, serving=serving, reason=reason,
                                  metrics=metrics))

    def metrics(self, version: int) -> records.Metrics:
        """The version as status() shows it (participants, committed, failed, state)."""
        self._count()
        return self.coordinator.call(records.GetMetrics(version=version))

    # -- broadcast transport: group membership (actor.py) ---------------------------------------

    def bcast_form(self, version: int, ahead: bool = False) -> records.BroadcastGroup | None:
        """The group of ``version``; ``ahead``: formed in stage(), or None where some live
        receiver is not ready to take it before the barrier."""
        return self._send(records.BcastForm(party=self._party(), version=version, ahead=ahead)).group

    def bcast_group(self, version: int, timeout: float) -> records.BroadcastGroup:
        """The group of ``version`` once formed, with this receiver's rank."""
        return self._send(records.BcastGroup(party=self._party(), version=version, timeout=timeout))

    def bcast_check(self, version: int) -> records.GroupCheck:
        return self._send(records.BcastCheck(party=self._party(), version=version))

    def segment_at(self, version: int, ref: str, size: int) -> None:
        """A relay: this party writes ``version`` for its host's receivers into segment ``ref``."""
        self._send(records.SegmentAt(party=self._party(), version=version, ref=ref, size=size))

    def segment_of(self, version: int, timeout: float) -> records.SegmentRef:
        """A relay follower: where its host's relaying party writes ``version``."""
        return self._send(records.SegmentOf(party=self._party(), version=version, timeout=timeout))

    def bcast_failed(self, version: int, error: str, timeout: float) -> str:
        """Returns the reason the version was aborted with, naming the party at fault."""
        request = records.BcastFailed(party=self._party(), version=version, error=error, timeout=timeout)
        return self._send(request).reason


def node_identity() -> tuple[str, str]:
    """(host address, Ray node id). Parties with equal node ids share a node (its /dev/shm, its
    devices); the host decides only without Ray (transports.on_one_node)."""
    if ray.is_initialized():
        try:
            return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        except Exception:
            pass
    return socket.gethostname(), ""


@dataclasses.dataclass(frozen=True)
class Rejoin:
    """What a restarted coordinator must learn from a party that registers again, as its owner
    last pushed it (:meth:`Member.remember`): the newest version a sender staged and what it
    published; the version a receiver serves, where its bytes are, and whether it accepted the
    session's manifest."""

    last_version: int | None = None
    publication: Publication | None = None
    serving: int | None = None
    served: Served | None = None
    accepted: bool = False


_KEEP: Any = object()  # remember(): a field not given keeps its value


class Member:
    """One party's membership of the session, held by a WeightSender or a WeightReceiver (its
    owner): its identity (``role``, ``name``, ``rank``, ``host``, ``node_id``, ``device``,
    ``config``), its registration (``party_id``, ``session``), the heartbeat thread and the
    control plane (``control``). Built without touching the network; :meth:`open` registers.

    When the coordinator restarts, the first call that notices re-registers and tells it what
    the owner pushed with :meth:`remember`, then replays the owner's publication (a sender) or
    its verdict on the manifest (a receiver); the member never asks its owner."""

    def __init__(self, coordinator: Coordinator, *, role: str, name: str, rank: int,
                 config: SyncConfig | None = None, device: str | None = None):
        self.coordinator = coordinator
        self.role, self.name, self.rank = role, name, rank
        self.config = config or coordinator.config
        self.device: torch.device = resolve(device or self.config.device)
        self.host, self.node_id = node_identity()
        # where it runs, as registration tells the coordinator and the transport choice reads it
        self.placement = records.Placement(name=name, rank=rank, host=self.host, node_id=self.node_id,
                                           device=records.Device(**describe(self.device)))
        self.party_id: int | None = None  # set by open(): the coordinator's id for this party
        self.session: str | None = None
        self.control = ControlPlane(coordinator, lambda: self.party_id, self._rejoin)
        self._known = Rejoin()
        self._known_lock = threading.Lock()
        self._rejoin_lock = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def remember(self, *, last_version: int | None = _KEEP, publication: Publication | None = _KEEP,
                 serving: int | None = _KEEP, served: Served | None = _KEEP, accepted: bool = _KEEP) -> None:
        """What a restarted coordinator must learn from this party, pushed by its owner as it
        changes; a field not given keeps its value. A sender: ``last_version`` once it opened a
        version, ``publication`` once the coordinator took it. A receiver: ``accepted`` once it
        told the coordinator it accepts the manifest; ``serving`` whenever the version it holds
        whole changes (None while a load has begun), with ``served`` (where that version's
        bytes are) when it commits one."""
        given = {"last_version": last_version, "publication": publication, "serving": serving, "served": served,
                 "accepted": accepted}
        with self._known_lock:
            self._known = dataclasses.replace(self._known, **{k: v for k, v in given.items() if v is not _KEEP})

    def open(self) -> Member:
        """Register with the coordinator and start the heartbeat. Idempotent.

        Returns:
            This member.

        Raises:
            WeightSyncError: The coordinator is unreachable or refused the registration.
        """
        if self._beat is None:
            self._register()
            self._beat = threading.Thread(target=self._heartbeat, name=f"weightsync-heartbeat-{self.name}",
                                          daemon=True)
            self._beat.start()
        return self

    def _register(self) -> Rejoin:
        known = self._known
        serving = known.serving
        reply = self.coordinator.call(records.Register(
            role=self.role, name=self.name, rank=self.rank, host=self.host, os_pid=os.getpid(), node_id=self.node_id,
            device=self.placement.device, last_version=known.last_version, serving=serving,
            served=known.served if serving is not None else None,
        ), rpc_timeout=self.config.connect_timeout_s)
        self.party_id, self.session = reply.party, reply.session
        return known

    def _rejoin(self, stale: int) -> None:
        """The coordinator restarted and lost the session: join again, and replay what the
        session had of this party beyond its registration. Only the first thread to notice
        re-registers (the heartbeat and the owner's calls race here)."""
        with self._rejoin_lock:
            if self.party_id != stale:
                return
            known = self._register()
            once = self.control.without_rejoin()  # a second SessionLost reaches the caller
            if known.publication is not None:
                once.publish(known.publication)
            if known.accepted:
                once.verdict(True)

    def _heartbeat(self) -> None:
        interval = self.config.heartbeat_interval_s
        while not self._stop.wait(interval):
            try:
                self.control.heartbeat(rpc_timeout=interval * 2)
            except Exception:
                pass  # the coordinator reports us silent if this keeps failing

    def account(self, kind: str, delta: int) -> None:
        """Open (+1) / close (-1) of a segment or handle, so leaks show in status(); never
        raises: accounting must not break a transfer or a shutdown."""
        try:
            self.control.resource(kind, delta)
        except Exception:
            pass

    def close(self) -> None:
        """Stop the heartbeat and leave the session. Idempotent; the owner closes its transport first."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.party_id is None:
            return  # never opened: the coordinator does not know it
        try:
            self.control.leave()
        except Exception:
            pass


class HoldsMember:
    """What a WeightSender and a WeightReceiver show of the Member each holds: who it is, its
    session and its calls to the coordinator, answered by the member. Delegation only: the
    member never calls back into its owner, and each owner closes its own transport first."""

    member: Member

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

    def open(self) -> Any:
        """Register with the coordinator and start the heartbeat. Idempotent; the constructor
        calls it, so users never need to.

        Returns:
            This party.

        Raises:
            WeightSyncError: The coordinator is unreachable or refused the registration.
        """
        self.member.open()
        return self

    def close(self) -> None:
        """Leave the session (an owner releases its own resources first)."""
        self.member.close()

    def __enter__(self) -> Any:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
