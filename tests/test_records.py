"""The typed records a transport's sender publishes for its receivers (records.py and each transport's
records.py):
each survives the control plane's msgpack unchanged, and a malformed one is refused where it
arrives with a ProtocolError naming the transport and the field."""

from __future__ import annotations

import dataclasses
import types

import msgpack
import pytest

from weightsync import records as base
from weightsync import transports
from weightsync.errors import ProtocolError
from weightsync.transports import shm_session, shm_version
from weightsync.transports.broadcast import records as broadcast_records
from weightsync.transports.ipc import records as ipc_records
from weightsync.transports.shm import transport as shm_records

# every transport's records (each in its own folder) and the base ones, by name
R = types.SimpleNamespace(**{**vars(base), **vars(ipc_records), **vars(shm_records), **vars(broadcast_records),
                             "shm_session": shm_session, "shm_version": shm_version})

HOST = R.HostBuffer(segment="memfd:1234:5", bytes=4096)
# the values ipc.wire.export_handle takes from torch's reduce_tensor for a CUDA buffer
CUDA = R.DeviceHandle(kind="cuda", physical=3, size=[4096], stride=[1], offset=0, typed=False, dtype="uint8",
                      handle=b"\x01" * 64, storage_bytes=4096, storage_offset=0, ref_handle=b"ref", ref_offset=0,
                      event=None, event_sync=True)
DEVICE = R.DeviceRecord(type="cpu", index=None, physical=None)
IPC = dict(control="memfd:1234:4", buffers=[HOST, HOST], nbuf=2, capacity=4096, digest_kind="xxh3", device=DEVICE)
BCAST = R.BroadcastSession(backend="gloo", communicator="torch", communicator_reason="gloo: torch's own",
                           host="10.0.0.1", port=29500, store_id="ab12", digest_kind="xxh3")

SAMPLES = [
    R.ShmSession(digest_kind="xxh3"),
    R.ShmSession(digest_kind=None),
    R.ShmVersion(segment="memfd:1234:3", size=8192, checksums=[1, 2**64 - 1], packed_bytes=5000, digest="x3:ab"),
    R.ShmVersion(segment="/dev/shm/wsync-1", size=8192),  # the early part, announced before packing
    R.IpcSession(**IPC),
    R.IpcVersion(session=R.IpcSession(**IPC), digest="x3:cd"),
    R.IpcSession(**{**IPC, "buffers": [CUDA, CUDA], "device": R.DeviceRecord(type="cuda", index=0, physical=3),
                    "digest_kind": "torch"}),
    HOST,
    CUDA,
    R.ShmStreamSession(**IPC),
    R.ShmStreamVersion(session=R.ShmStreamSession(**IPC)),
    BCAST,
    R.BroadcastVersion(session=BCAST, digest="torch:ef"),
]


def ids(r: R.Record) -> str:
    return type(r).__name__


@pytest.mark.parametrize("record", SAMPLES, ids=ids)
def test_a_record_comes_back_equal_through_msgpack(record):
    wire = msgpack.unpackb(msgpack.packb(record.to_wire()), raw=False)
    assert type(record).from_wire(wire) == record


def required(record: R.Record) -> list[str]:
    return [f.name for f in dataclasses.fields(record)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


@pytest.mark.parametrize("record", SAMPLES, ids=ids)
def test_a_missing_field_is_a_protocol_error_naming_the_transport_and_field(record):
    assert required(record), "every record has a required field"
    for name in required(record):
        wire = record.to_wire()
        del wire[name]
        with pytest.raises(ProtocolError, match=rf"^{record.transport}: {type(record).__name__} lacks field '{name}'"):
            type(record).from_wire(wire)


@pytest.mark.parametrize("record", SAMPLES, ids=ids)
def test_an_unknown_field_is_a_protocol_error_naming_the_transport_and_field(record):
    with pytest.raises(ProtocolError, match=rf"^{record.transport}: {type(record).__name__} has unknown field 'slots'"):
        type(record).from_wire({**record.to_wire(), "slots": 4})


@pytest.mark.parametrize("record", SAMPLES, ids=ids)
def test_a_wrongly_typed_field_is_a_protocol_error_naming_the_transport_and_field(record):
    for f in dataclasses.fields(record):
        with pytest.raises(ProtocolError, match=rf"^{record.transport}: {type(record).__name__} field '{f.name}' is "
                                                rf"float, not "):
            type(record).from_wire({**record.to_wire(), f.name: 1.5})


def test_a_bool_is_no_int_and_values_are_checked():
    wire = BCAST.to_wire()
    with pytest.raises(ProtocolError, match="^broadcast: BroadcastSession field 'port' is bool, not int"):
        R.BroadcastSession.from_wire({**wire, "port": True})
    with pytest.raises(ProtocolError, match="^broadcast: BroadcastSession: field 'port' is 0, not a TCP port"):
        R.BroadcastSession.from_wire({**wire, "port": 0})
    with pytest.raises(ProtocolError, match="^ipc: IpcSession: field 'nbuf' is 3, not the number of buffers"):
        R.IpcSession.from_wire({**R.IpcSession(**IPC).to_wire(), "nbuf": 3})
    with pytest.raises(ProtocolError, match="^shm: ShmSession: field 'digest_kind' is 'crc32'"):
        R.ShmSession.from_wire({"digest_kind": "crc32", "mode": "whole"})
    with pytest.raises(ProtocolError, match=r"^shm: ShmVersion field 'checksums'\[1\] is str, not int"):
        R.ShmVersion.from_wire({**SAMPLES[2].to_wire(), "checksums": [1, "2"]})


def test_a_nested_record_names_its_own_field():
    wire = R.IpcVersion(session=R.IpcSession(**IPC)).to_wire()
    del wire["session"]["device"]["type"]
    with pytest.raises(ProtocolError, match="^ipc: DeviceRecord lacks field 'type'"):
        R.IpcVersion.from_wire(wire)


def test_a_buffer_is_a_host_buffer_or_a_device_handle_and_a_bad_one_says_why():
    wire = R.IpcSession(**IPC).to_wire()
    wire["buffers"][1] = {"kind": "host", "segment": "memfd:1234:6"}
    with pytest.raises(ProtocolError, match=r"^ipc: IpcSession field 'buffers'\[1\] is dict, not HostBuffer / "
                                            r"DeviceHandle \(ipc: HostBuffer lacks field 'bytes'; "):
        R.IpcSession.from_wire(wire)


def test_the_coordinators_note_of_a_broadcast_group_is_no_unknown_field():
    record = R.BroadcastVersion(session=BCAST)
    wire = {**record.to_wire(), "group": {"epoch": 1, "members": ["rollout-0"]}}  # coordinator/actor.py, bcast_form
    assert R.BroadcastVersion.from_wire(wire) == record


@pytest.mark.parametrize("wire,mode", [({}, None), ({"mode": "ring"}, "'ring'")])
def test_shm_tells_its_modes_by_the_mode_field(wire, mode):
    assert isinstance(R.shm_version(SAMPLES[3].to_wire()), R.ShmVersion)
    assert isinstance(R.shm_version(SAMPLES[10].to_wire()), R.ShmStreamVersion)
    assert isinstance(R.shm_session(SAMPLES[9].to_wire()), R.ShmStreamSession)
    with pytest.raises(ProtocolError, match=rf"^shm: version field 'mode' is {mode}"):
        R.shm_version(wire)


@pytest.mark.parametrize("name,session", [
    ("shm", R.ShmSession(digest_kind="xxh3")),
    ("shm", R.ShmStreamSession(**IPC)),
    ("ipc", R.IpcSession(**IPC)),
    ("broadcast", BCAST),
], ids=["shm", "shm-stream", "ipc", "broadcast"])
def test_a_session_record_without_its_digest_kind_is_refused_where_it_arrives(name, session):
    """A receiver parses the sender's session record with its transport's declaration before it
    builds anything: a record without its digest kind names the transport and the field."""
    wire = session.to_wire()
    assert transports.get(name).session(wire) == session
    del wire["digest_kind"]
    with pytest.raises(ProtocolError, match=rf"^{session.transport}: {type(session).__name__} lacks field 'digest_kind'"):
        transports.get(name).session(wire)
