"""The control channel (its server in weightsync/coordinator/actor.py, its client end in
weightsync/coordinator/client.py): the coordinator's calls over a TCP port of its own, beside
Ray, with Ray's answers and Ray's failure semantics. ``Status.via`` counts the payloads the
coordinator served by the way they came."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import ray
from support.parties import wait_until

from weightsync import records
from weightsync.coordinator.client import Link

CONFIG = {"transport": "shm", "bucket_mb": 1 / 16}


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
