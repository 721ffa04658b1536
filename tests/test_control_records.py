"""The control plane's records (weightsync/records.py) on the wire, both directions: a request the
coordinator decodes, a reply the client decodes. A field unknown, missing or of the wrong type
is a ProtocolError naming the record and the field, never a TypeError or KeyError further on."""

from __future__ import annotations

import asyncio
import dataclasses
import types
import typing
import warnings

import pytest

from weightsync import records
from weightsync.config import SyncConfig
from weightsync.coordinator import client
from weightsync.coordinator.actor import CoordinatorActor
from weightsync.errors import ProtocolError

REQUESTS = sorted(records.REQUESTS.values(), key=lambda c: c.__name__)
REPLIES = sorted({c.reply for c in REQUESTS}, key=lambda c: c.__name__)
TOKEN = "t" * 32


def sample(tp):
    """A valid value of annotation ``tp``: every field set, nested records included."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return sample(next(a for a in typing.get_args(tp) if a is not type(None)))
    if dataclasses.is_dataclass(tp):
        hints = records.hints_of(tp)
        return tp(**{f.name: sample(hints[f.name]) for f in dataclasses.fields(tp)})
    origin = typing.get_origin(tp) or tp
    return {int: 1, float: 1.5, str: "x", bool: True, list: [], dict: {}}.get(origin, "x")


def wrong(tp):
    """A value no field of annotation ``tp`` accepts."""
    return 1.5 if sample(tp) == "x" else "x"


def first_field(cls) -> dataclasses.Field:
    return dataclasses.fields(cls)[0]


def required(cls) -> str:
    return next(f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


# -- request: the coordinator decodes ---------------------------------------------------------


def served(op: str, args) -> dict:
    """What the actor answers to ``op`` with ``args``, run without Ray."""
    actor = CoordinatorActor(SyncConfig().to_dict(), TOKEN)

    async def call() -> bytes:
        try:
            return await actor.rpc(records.encode({"op": op, "token": TOKEN, "args": args}))
        finally:
            actor._monitor.cancel()

    return records.decode(asyncio.run(call()))


@pytest.mark.parametrize("cls", REQUESTS, ids=lambda c: c.__name__)
def test_request_with_an_unknown_field_is_refused_naming_it(cls):
    reply = served(cls.__name__, {**sample(cls).to_wire(), "bogus": 1})
    assert (reply["kind"], reply["error"].split(" (")[0]) == (
        "ProtocolError", f"control: {cls.__name__} has unknown field 'bogus'")


@pytest.mark.parametrize("cls", [c for c in REQUESTS if dataclasses.fields(c)], ids=lambda c: c.__name__)
def test_request_missing_a_field_is_refused_naming_it(cls):
    name = required(cls)
    wire = sample(cls).to_wire()
    del wire[name]
    assert served(cls.__name__, wire)["error"] == f"control: {cls.__name__} lacks field {name!r}"


@pytest.mark.parametrize("cls", [c for c in REQUESTS if dataclasses.fields(c)], ids=lambda c: c.__name__)
def test_request_with_a_field_of_the_wrong_type_is_refused_naming_it(cls):
    f = first_field(cls)
    wire = {**sample(cls).to_wire(), f.name: wrong(records.hints_of(cls)[f.name])}
    assert served(cls.__name__, wire)["error"].startswith(f"control: {cls.__name__} field {f.name!r} is ")


def test_an_unknown_request_is_refused_naming_it():
    assert served("OpBeginStage", {})["error"] == "unknown op 'OpBeginStage'"


# -- reply: the client decodes ----------------------------------------------------------------


class Answer:
    """An actor handle whose ``rpc`` answers with one fixed reply."""

    def __init__(self, reply: dict):
        self.rpc = types.SimpleNamespace(remote=lambda payload: records.encode(reply))


def asked(monkeypatch, request: records.Request, type_name: str, result) -> records.Message:
    monkeypatch.setattr(client.ray, "get", lambda ref, timeout: ref)
    coord = client.Coordinator(Answer({"ok": True, "type": type_name, "result": result}), "c", "", TOKEN,
                               SyncConfig())
    return coord.call(request)


def request_for(reply: type[records.Message]) -> records.Request:
    return sample(next(c for c in REQUESTS if c.reply is reply))


@pytest.mark.parametrize("cls", REPLIES, ids=lambda c: c.__name__)
def test_reply_round_trips(monkeypatch, cls):
    value = sample(cls)
    assert asked(monkeypatch, request_for(cls), cls.__name__, value.to_wire()) == value


@pytest.mark.parametrize("cls", REPLIES, ids=lambda c: c.__name__)
def test_reply_with_an_unknown_field_is_refused_naming_it(monkeypatch, cls):
    with pytest.raises(ProtocolError, match=rf"^control: {cls.__name__} has unknown field 'bogus'"):
        asked(monkeypatch, request_for(cls), cls.__name__, {**sample(cls).to_wire(), "bogus": 1})


@pytest.mark.parametrize("cls", [c for c in REPLIES if dataclasses.fields(c)], ids=lambda c: c.__name__)
def test_reply_missing_a_field_is_refused_naming_it(monkeypatch, cls):
    name = required(cls)
    wire = sample(cls).to_wire()
    del wire[name]
    with pytest.raises(ProtocolError, match=rf"^control: {cls.__name__} lacks field '{name}'$"):
        asked(monkeypatch, request_for(cls), cls.__name__, wire)


@pytest.mark.parametrize("cls", [c for c in REPLIES if dataclasses.fields(c)], ids=lambda c: c.__name__)
def test_reply_with_a_field_of_the_wrong_type_is_refused_naming_it(monkeypatch, cls):
    f = first_field(cls)
    wire = {**sample(cls).to_wire(), f.name: wrong(records.hints_of(cls)[f.name])}
    with pytest.raises(ProtocolError, match=rf"^control: {cls.__name__} field '{f.name}' is "):
        asked(monkeypatch, request_for(cls), cls.__name__, wire)


def test_a_reply_of_another_type_is_refused_naming_both(monkeypatch):
    with pytest.raises(ProtocolError, match="^control: BeginStage was answered with 'Done', not Slot"):
        asked(monkeypatch, records.BeginStage(party=1, version=1), "Done", {})


def test_a_nested_record_names_its_own_field(monkeypatch):
    wire = {"receivers": [{"name": "r0", "device": {"type": "cuda", "physical": "0"}}]}
    with pytest.raises(ProtocolError, match=r"^control: Placement field 'device' is dict, not Device / NoneType "
                                            r"\(control: Device field 'physical' is str, not int / NoneType;"):
        asked(monkeypatch, records.Receivers(party=1, count=1, timeout=1.0), "Placements", wire)


# a map whose keys the coordinator does not know (a transport's record in its wire form, parsed
# strictly where it arrives, records.py; the config, SyncConfig.from_mapping) is a
# WireMap: plain msgpack data, checked on arrival; no record field is left ``Any``
def test_no_record_field_is_left_untyped():
    messages = [c for c in vars(records).values() if isinstance(c, type) and issubclass(c, records.Message)]
    untyped = sorted(f"{c.__name__}.{name}" for c in messages for name, tp in records.hints_of(c).items()
                     if "Any" in str(tp) or tp in (dict, list))
    assert untyped == []


def test_every_forwarded_record_and_the_config_are_wire_maps():
    messages = [c for c in vars(records).values() if isinstance(c, type) and issubclass(c, records.Message)]
    found = {(c.__name__, name): str(tp) for c in messages for name, tp in records.hints_of(c).items()
             if name in ("info", "config")}
    assert len(found) == 13
    assert {k: v for k, v in found.items() if v not in ("dict[str, Wire]", "dict[str, Wire] | None")} == {}


@pytest.mark.parametrize(("bad", "why"), [
    ({"ring": {"slots": [1, {2: "x"}]}}, r"\['ring'\]\['slots'\]\[1\] has a key of type int \(2\), not str"),
    ({"ring": {"slots": [1, [None, True, 1.5, b"x", {"deep": {}}]]}, "at": None}, None),
])
def test_a_wire_map_is_checked_on_arrival_naming_the_record_and_the_field(bad, why):
    wire = {"party": 1, "version": 3, "info": bad, "stage_s": 0.5}
    if why is None:
        assert records.Staged.from_wire(wire).info == bad
    else:
        with pytest.raises(ProtocolError, match=rf"^control: Staged field 'info'{why}$"):
            records.Staged.from_wire(wire)


def test_a_wire_value_that_is_no_plain_data_or_nests_without_end_is_refused():
    with pytest.raises(ProtocolError, match=r"^x\['a'\]\[0\] is set, not a wire value"):
        records.wire_value({"a": [set()]}, "x")
    deep: dict = {}
    for _ in range(records.MAX_WIRE_DEPTH + 1):
        deep = {"a": deep}
    with pytest.raises(ProtocolError, match=rf"nests deeper than {records.MAX_WIRE_DEPTH} levels$"):
        records.wire_value(deep, "x")


def test_a_request_whose_info_is_no_wire_map_is_refused_by_the_coordinator():
    args = {**sample(records.StageInfo).to_wire(), "info": {"x": {b"k": 1}}}
    assert served("StageInfo", args)["error"] == (
        "control: StageInfo field 'info'['x'] has a key of type bytes (b'k'), not str")


def failed_with(monkeypatch, reply: dict):
    monkeypatch.setattr(client.ray, "get", lambda ref, timeout: ref)
    coord = client.Coordinator(Answer({"ok": False, **reply}), "c", "", TOKEN, SyncConfig())
    return coord.call(records.BeginSync(party=1, version=3))


def test_a_failure_is_raised_as_the_coordinators_own_error(monkeypatch):
    from weightsync.errors import SyncFailed

    with pytest.raises(SyncFailed) as got:
        failed_with(monkeypatch, records.Failure(kind="SyncFailed", error="", version=3, failed={"r0": "died"},
                                                 committed=["r1"]).to_wire())
    assert (got.value.version, got.value.failed, got.value.committed) == (3, {"r0": "died"}, ["r1"])


def test_a_failure_with_a_field_of_the_wrong_type_is_refused_naming_it(monkeypatch):
    with pytest.raises(ProtocolError, match=r"^control: Failure field 'failed' is list, not dict / NoneType"):
        failed_with(monkeypatch, {"kind": "SyncFailed", "error": "", "version": 3, "failed": ["r0"]})


# -- the records the public API returns: dict-style reads, deprecated for one release ---------


def measured(nbytes: int) -> records.ReceiverMetrics:
    return records.ReceiverMetrics(wait_s=0.1, verify_s=0.2, load_s=0.3, post_load_s=0.0, reset_cache_s=0.0,
                                   total_s=0.6, bytes=nbytes, peer_verified_buckets=0, gbps=1.0, received_ahead=False,
                                   digest="xxh3:00ff", calls=5)


def staged_version() -> records.Metrics:
    """A version at its barrier, as the coordinator records it: not finished, one receiver reported."""
    return records.Metrics(version=3, state="TRANSFERRING", slot=0, reason="", participants=["r0", "r1"],
                           committed=["r0"], failed={}, phases_s={"stage_s": 0.5}, receivers={"r0": measured(64)},
                           bytes=64, info={"segment": "memfd:1:2"}, digest="xxh3:00ff",
                           receiver_digests={"r0": "xxh3:00ff"})


def test_a_record_read_as_a_dict_answers_as_the_map_it_was_and_warns():
    m = staged_version()
    with pytest.warns(DeprecationWarning, match=r"^reading a weightsync record as a dict is deprecated \(Metrics"):
        got = (m["state"], m["receivers"]["r0"]["bytes"], m.get("barrier_s", "absent"), "gbps" in m, sorted(m)[:2])
    assert got == ("TRANSFERRING", 64, "absent", False, ["bytes", "committed"])


def test_the_deprecation_names_the_line_that_read_the_record():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        staged_version().get("state")
    assert [(w.category, w.filename) for w in seen] == [(DeprecationWarning, __file__)]
