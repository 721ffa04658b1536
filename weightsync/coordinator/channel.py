"""Internal. The control channel: the coordinator's calls over a plain TCP connection, beside Ray.

One Ray actor call costs 1-2.5 ms of round trip on a loaded 2-core machine, and a version makes
several on its critical path (figures: docs/design.md, Parties). The coordinator serves the
same payloads on a TCP port of its own event loop: a frame is a 4-byte big-endian length and the
msgpack payload exactly as ``CoordinatorActor.rpc`` takes it; the reply frame is exactly what
``rpc`` returns, so the token check and the decoding stay in one place and nothing new is
unpickled. Each connection serves its frames in order; a client holds one connection per thread
(a long poll blocks only its own).

A failed connection is :class:`Broken` (the client sends the call through Ray instead, which
reaches a restarted actor); a reply that does not come by the deadline is ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable

import ray

from ..errors import ProtocolError, WeightSyncError
from ..records import MAX_MESSAGE_BYTES, ChannelAddress

HEADER = 4
# a port nobody answers on (a firewall that drops packets) must not cost a call its whole
# deadline; a live actor's kernel completes the handshake without waiting for its loop
CONNECT_S = 5.0


class Broken(Exception):
    """The connection failed (reset, closed mid-reply): the actor is gone or restarted."""


class Unreachable(Broken):
    """No connection could be opened (refused, or no answer within ``CONNECT_S``)."""


# -- the coordinator's end ------------------------------------------------------------------


class Server:
    """Serves ``handler`` (the actor's ``rpc``) on a port the OS picks. ``served``: payloads the
    handler took, whichever way they came (the actor counts them); ``frames``: those that came
    over the channel."""

    def __init__(self, handler: Callable[[bytes], Awaitable[bytes]]):
        self.handler = handler
        self.served = self.frames = 0
        self._opening: asyncio.Task | None = None
        self._server: asyncio.AbstractServer | None = None

    def via(self) -> dict[str, int]:
        """Payloads served by the way they came (status()["via"])."""
        return {"ray": self.served - self.frames, "socket": self.frames}

    async def open(self, mode: str) -> ChannelAddress:
        """Where the channel listens, from the first call on; ``mode``: the config's
        ``control_channel``.

        Raises:
            ProtocolError: ``mode`` is not "socket": clients keep to Ray.
            WeightSyncError: The port could not be opened (the next ask tries again).
        """
        if mode != "socket":
            raise ProtocolError(f"this coordinator serves no control channel (control_channel: {mode})")
        if self._opening is None:
            # a task, not a plain await: calls asking at once all wait for the one port it opens
            self._opening = asyncio.get_running_loop().create_task(self._start())
        try:
            return await asyncio.shield(self._opening)
        except OSError as exc:
            self._opening = None
            raise WeightSyncError(f"cannot open the control channel: {exc}") from None

    async def _start(self) -> ChannelAddress:
        host = ray.util.get_node_ip_address()  # the address other nodes reach this one by
        self._server = await asyncio.start_server(self._serve, host, 0)
        return ChannelAddress(host=host, port=self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(HEADER), "big")
                if size > MAX_MESSAGE_BYTES:
                    return  # no way to find the next frame; the client's call goes through Ray instead
                payload = await reader.readexactly(size)
                self.frames += 1
                reply = await self.handler(payload)
                writer.write(len(reply).to_bytes(HEADER, "big") + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed (its thread ended, or it gave up waiting)
        finally:
            writer.close()


# -- a party's end --------------------------------------------------------------------------


class Link:
    """Connections to one coordinator's channel at ``address``, one per calling thread."""

    def __init__(self, address: tuple[str, int]):
        self.address = address
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
        sock = self._connection(deadline)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            sock.sendall(len(payload).to_bytes(HEADER, "big") + payload)
            size = int.from_bytes(_read(sock, HEADER, deadline), "big")
            if size > MAX_MESSAGE_BYTES:
                raise Broken(f"a reply frame of {size} bytes")
            return _read(sock, size, deadline)
        except TimeoutError:
            self.drop()
            raise
        except (OSError, Broken) as exc:
            self.drop()
            raise Broken(str(exc)) from None

    def _connection(self, deadline: float) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            try:
                timeout = min(CONNECT_S, max(deadline - time.monotonic(), 1e-3))
                sock = socket.create_connection(self.address, timeout=timeout)
            except OSError as exc:  # a connect timeout included: nobody answers there
                raise Unreachable(f"cannot connect to {self.address[0]}:{self.address[1]}: {exc}") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.sock = sock
        return sock

    def drop(self) -> None:
        """Close this thread's connection (the next call opens a new one)."""
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            sock.close()


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
