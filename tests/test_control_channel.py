"""The control channel (its server in weightsync/coordinator/actor.py, its client end in
weightsync/coordinator/client.py): the coordinator's calls over a TCP port of its own, beside
Ray, with Ray's answers and Ray's failure semantics. ``Status.via`` counts the payloads the
coordinator served by the way they came."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import ray
from support.parties import serves, wait_until
from weightsync_bench.layouts import layout

from weightsync import records
from weightsync.coordinator.client import Link

CONFIG = {"transport": "shm", "bucket_mb": 1 / 16}
TINY = layout("tiny")


def test_with_the_socket_channel_every_call_but_the_address_lookups_goes_over_it(start_job):
    job = start_job({**CONFIG, "control_channel": "socket"})
    job.step(1)
    status = job.coordinator.status()
    calls = status.calls
    assert status.via == {"ray": calls["channel"], "socket": sum(calls.values()) - calls["channel"]}


def test_with_control_channel_ray_nothing_goes_over_the_socket(start_job):
    job = start_job({**CONFIG, "control_channel": "ray"})
    job.step(1)
    status = job.coordinator.status()
    assert status.via == {"ray": sum(status.calls.values()), "socket": 0}


def test_a_coordinator_killed_mid_session_is_reached_through_ray_and_the_next_version_commits(start_job):
    job = start_job({**CONFIG, "control_channel": "socket"})
    job.step(1)
    before = job.coordinator.status().session
    ray.kill(job.coordinator.actor, no_restart=False)  # Ray restarts it with an empty session
    # each party's next call breaks on the dead connection, goes through Ray, is answered
    # SessionLost by the new incarnation, and the party registers again
    wait_until("every party re-registered with the new coordinator", lambda: (
        (s := job.coordinator.status()).session != before
        and sorted(p.name for p in s.parties if p.alive) == ["rollout-0", "rollout-1", "trainer-0"]))
    applied, _ = job.step(2)
    s = job.coordinator.status()
    fell_back = s.via["ray"] > s.calls.get("channel", 0)  # Ray served more than the address lookups
    assert (fell_back, applied, s.latest_committed) == (True, [2, 2], 2)


def frame(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(len(payload).to_bytes(4, "big") + payload)
    size = int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "big")
    return sock.recv(size, socket.MSG_WAITALL)


@pytest.mark.parametrize("payload", [
    b"\x80\x04\x95junk",  # a pickle stream's head, not msgpack
    records.encode({"op": "GetStatus", "token": "not-the-token", "args": {}}),
], ids=["malformed", "wrong-token"])
def test_a_bad_frame_over_the_socket_gets_the_protocol_error_ray_gives(coordinator_factory, payload):
    coord = coordinator_factory({"control_channel": "socket"})
    address = coord.call(records.Channel())
    with socket.create_connection((address.host, address.port), timeout=30) as sock:
        hello = records.HELLO + coord.token.encode()
        sock.sendall(len(hello).to_bytes(4, "big") + hello)  # the session's own token: then frames are read
        over_socket = frame(sock, payload)
    over_ray = ray.get(coord.actor.rpc.remote(payload))
    assert (over_socket, records.decode(over_socket)["kind"]) == (over_ray, "ProtocolError")


def slow_echo(server: socket.socket, delay: float) -> None:
    """Answer each frame with its own payload, ``delay`` seconds late, on every connection."""
    def serve(conn: socket.socket) -> None:
        with conn:
            while head := conn.recv(4, socket.MSG_WAITALL):
                payload = conn.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL)
                time.sleep(delay)
                conn.sendall(head + payload)

    while True:
        try:
            conn, _ = server.accept()
        except OSError:  # the test closed the server
            return
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def test_a_reply_later_than_its_deadline_is_a_timeout_and_never_answers_the_next_call():
    with socket.create_server(("127.0.0.1", 0)) as server:
        threading.Thread(target=slow_echo, args=(server, 0.5), daemon=True).start()
        link = Link(server.getsockname()[:2])
        with pytest.raises(TimeoutError):
            link.call(b"first", time.monotonic() + 0.1)
        assert link.call(b"second", time.monotonic() + 30) == b"second"


def closed_unanswered(sock: socket.socket, within: float) -> bool:
    """Whether the coordinator closes ``sock`` within ``within`` seconds without a byte of reply."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("first", [
    b"\x04\x00\x00\x00",  # a frame of 64 MiB announced: never read
    (len(records.HELLO) + 32).to_bytes(4, "big") + records.HELLO + b"0" * 32,  # a hello with a wrong token
    records.encode({"op": "GetStatus", "token": "x", "args": {}}),  # a request before the hello
    b"",  # nothing at all: the connection idles
], ids=["huge-frame", "wrong-token", "no-hello", "idle"])
def test_a_connection_that_does_not_prove_the_token_first_is_closed_unanswered(coordinator_factory, first):
    coord = coordinator_factory({"control_channel": "socket"})
    address = coord.call(records.Channel())
    with socket.create_connection((address.host, address.port), timeout=30) as sock:
        if first[:1] == b"\x83":  # a msgpack map: framed as a request
            first = len(first).to_bytes(4, "big") + first
        sock.sendall(first)
        # an idle one waits out the hello's deadline; the others are closed at once
        assert closed_unanswered(sock, 15.0 if not first else 5.0)


def _rss_mib(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def _coordinator_pid(job) -> int:
    # asked of the job's coordinator actor: a search by process name finds any coordinator on the
    # machine (the other xdist worker's, another run's)
    return ray.get(job.coordinator.actor.__ray_call__.remote(lambda _self: os.getpid()))


def test_hostile_clients_without_the_token_cost_little_and_versions_keep_committing(start_job):
    """200 clients without the token connect and idle, 24 more announce 64 MiB frames and trickle
    bytes into them: the coordinator's memory grows by less than 64 MiB, and versions commit
    bit-exact meanwhile (a party whose new connection is refused calls through Ray)."""
    job = start_job({**CONFIG, "control_channel": "socket"})
    job.step(1)
    address = job.coordinator.call(records.Channel())
    pid = _coordinator_pid(job)
    before = _rss_mib(pid)
    hostile: list[socket.socket] = []
    try:
        for _ in range(200):
            hostile.append(socket.create_connection((address.host, address.port), timeout=10))
        streaming = [socket.create_connection((address.host, address.port), timeout=10) for _ in range(24)]
        hostile += streaming
        chunk = b"\0" * (1 << 20)

        def stream(sock: socket.socket) -> None:
            """All but the last MiB of a 64 MiB frame: a server that reads frames before the
            token would hold them all (24 x 63 MiB); a refused connection fails the send."""
            try:
                sock.sendall((64 << 20).to_bytes(4, "big"))
                for _ in range(63):
                    sock.sendall(chunk)
            except OSError:
                pass

        senders = [threading.Thread(target=stream, args=(sock,), daemon=True) for sock in streaming]
        for t in senders:
            t.start()
        for v in (2, 3):
            applied, _ = job.step(v)
            assert applied == [v, v] and [serves(r, TINY) for r in job.rollouts] == [v, v]
        for t in senders:
            t.join(60)
        grown = _rss_mib(pid) - before
    finally:
        for sock in hostile:
            sock.close()
    assert grown < 64, f"the coordinator grew by {grown:.0f} MiB"
