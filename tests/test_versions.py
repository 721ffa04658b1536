"""The version state machine alone: every transition, legal and illegal, without a Ray cluster."""

from __future__ import annotations

import pytest

from weightsync.coordinator.actor import (
    IN_FLIGHT,
    BroadcastGroups,
    Candidate,
    GroupMember,
    State,
    VersionTable,
    choose_slot,
    group_rank,
    pinned_slots,
)
from weightsync.errors import VersionError
from weightsync.records import ReceiverMetrics

MEASURED = ReceiverMetrics(wait_s=0.1, verify_s=0.2, load_s=0.3, post_load_s=0.0, reset_cache_s=0.0, total_s=1.0,
                           bytes=64, peer_verified_buckets=0, gbps=0.1, received_ahead=False, digest="d")


def slot0() -> int:
    return 0


def staged(table: VersionTable, version: int, slot: int = 0) -> None:
    table.begin_stage(version, lambda: slot, now=1.0)
    table.staged(version, {"where": "x"}, stage_s=0.5)


def syncing(table: VersionTable, version: int, *names: str) -> None:
    staged(table, version)
    table.begin_sync(version, [Candidate(n) for n in names], now=2.0)


# -- begin_stage --------------------------------------------------------------------------


def test_begin_stage_opens_staging_with_the_chosen_slot():
    table = VersionTable()
    v, superseded = table.begin_stage(3, lambda: 2, now=1.0)
    assert (v.state, v.slot, v.started, superseded) == (State.STAGING, 2, 1.0, [])


def test_begin_stage_refuses_a_reused_version():
    table = VersionTable()
    staged(table, 3)
    with pytest.raises(VersionError, match="version 3 is reused: the newest version of this session is 3"):
        table.begin_stage(3, slot0, now=2.0)


def test_begin_stage_refuses_a_version_going_backwards():
    table = VersionTable()
    staged(table, 5)
    with pytest.raises(VersionError, match="version 4 goes backwards"):
        table.begin_stage(4, slot0, now=2.0)


def test_begin_stage_refuses_versions_at_or_below_the_floor_after_a_restart():
    table = VersionTable()
    table.raise_floor(7)
    with pytest.raises(VersionError, match="version 7 goes backwards: the newest version of this session is 7"):
        table.begin_stage(7, slot0, now=1.0)
    assert table.begin_stage(8, slot0, now=1.0)[0].state == State.STAGING


def test_begin_stage_refuses_while_a_version_transfers():
    table = VersionTable()
    syncing(table, 1, "r0")
    with pytest.raises(VersionError, match="version 2 cannot start while version 1 is still transferring"):
        table.begin_stage(2, slot0, now=3.0)
    assert 2 not in table


@pytest.mark.parametrize("stage_only", [True, False])
def test_begin_stage_supersedes_staging_and_staged_versions(stage_only):
    table = VersionTable()
    table.begin_stage(1, slot0, now=1.0)
    if not stage_only:
        table.staged(1, {}, 0.1)
    v2, superseded = table.begin_stage(2, lambda: 1, now=2.0)
    assert [s.version for s in superseded] == [1]
    assert table[1].state == State.ABORTED and table[1].reason == "superseded by version 2 before its sync"
    assert table[1].finished == 2.0 and v2.state == State.STAGING


def test_slot_is_chosen_after_superseded_versions_gave_theirs_up():
    table = VersionTable()
    table.begin_stage(1, slot0, now=1.0)
    seen = []
    table.begin_stage(2, lambda: seen.append(pinned_slots(table, [], True)) or 0, now=2.0)
    assert seen == [set()]


# -- staged -------------------------------------------------------------------------------


def test_staged_moves_staging_to_staged_and_keeps_info():
    table = VersionTable()
    table.begin_stage(1, slot0, now=1.0)
    v = table.staged(1, {"segment": "s"}, stage_s=0.25)
    assert (v.state, v.info, v.phases) == (State.STAGED, {"segment": "s"}, {"stage_s": 0.25})


def test_staged_leaves_an_aborted_version_aborted():
    table = VersionTable()
    table.begin_stage(1, slot0, now=1.0)
    table.abort(1, "sender failed", now=1.5)
    assert table.staged(1, {}, 0.1).state == State.ABORTED


def test_staged_of_an_unknown_version_is_an_error():
    with pytest.raises(VersionError, match="version 9 is unknown to this session"):
        VersionTable().staged(9, {}, 0.1)


# -- abort --------------------------------------------------------------------------------


@pytest.mark.parametrize("state", sorted(IN_FLIGHT))
def test_abort_of_an_in_flight_version_names_the_reason_for_every_unsettled_participant(state):
    table = VersionTable()
    table.begin_stage(1, slot0, now=1.0)
    if state != State.STAGING:
        table.staged(1, {}, 0.1)
    if state == State.TRANSFERRING:
        table.begin_sync(1, [Candidate("a"), Candidate("b")], now=2.0)
        table.report(1, "a", True, "", None, now=2.5)
    assert table[1].state == state
    assert table.abort(1, "trainer crashed", now=3.0) is True
    v = table[1]
    assert (v.state, v.reason, v.finished) == (State.ABORTED, "trainer crashed", 3.0)
    expected = {"b": "version aborted: trainer crashed"} if state == State.TRANSFERRING else {}
    assert v.failed == expected


@pytest.mark.parametrize("final", [State.COMMITTED, State.ABORTED])
def test_abort_leaves_a_finished_version_as_it_is(final):
    table = VersionTable()
    syncing(table, 1, "a")
    table.report(1, "a", final == State.COMMITTED, "a: broke", None, now=3.0)
    before = (table[1].state, table[1].reason)
    assert table.abort(1, "late abort", now=4.0) is False
    assert (table[1].state, table[1].reason) == before == (final, "" if final == State.COMMITTED else "a: a: broke")


def test_abort_of_an_unknown_version_changes_nothing():
    assert VersionTable().abort(3, "why", now=1.0) is False


# -- begin_sync ---------------------------------------------------------------------------


def test_begin_sync_fixes_participants_sorted_and_names_failed_candidates():
    table = VersionTable()
    staged(table, 1)
    v = table.begin_sync(1, [Candidate("r1"), Candidate("r0", "receiver 'r0' silent")], now=2.0)
    assert (v.state, v.participants, v.failed, v.sync_started) == (
        State.TRANSFERRING, ["r0", "r1"], {"r0": "receiver 'r0' silent"}, 2.0)


def test_begin_sync_from_staging_is_allowed_for_pipelined_senders():
    table = VersionTable()
    table.begin_stage(1, slot0, now=1.0)
    assert table.begin_sync(1, [Candidate("r0")], now=2.0).state == State.TRANSFERRING


def test_begin_sync_with_no_receivers_commits_at_once():
    table = VersionTable()
    staged(table, 1)
    v = table.begin_sync(1, [], now=2.0)
    assert (v.state, table.latest_committed, v.finished) == (State.COMMITTED, 1, 2.0)


def test_begin_sync_where_every_participant_already_failed_aborts_naming_them():
    table = VersionTable()
    staged(table, 1)
    v = table.begin_sync(1, [Candidate("r0", "dead")], now=2.0)
    assert (v.state, v.reason) == (State.ABORTED, "r0: dead")


def test_begin_sync_twice_keeps_the_first_participants():
    table = VersionTable()
    syncing(table, 1, "r0")
    v = table.begin_sync(1, [Candidate("r0"), Candidate("r9")], now=3.0)
    assert (v.participants, v.sync_started) == (["r0"], 2.0)


def test_begin_sync_of_a_never_staged_version_is_an_error():
    with pytest.raises(VersionError, match=r"sync\(4\) was called but version 4 was never staged"):
        VersionTable().begin_sync(4, [], now=1.0)


def test_begin_sync_of_an_aborted_version_is_an_error_with_its_reason():
    table = VersionTable()
    table.begin_stage(1, slot0, now=1.0)
    table.abort(1, "pack failed", now=1.1)
    with pytest.raises(VersionError, match="version 1 was aborted while staging: pack failed"):
        table.begin_sync(1, [], now=2.0)


# -- report -------------------------------------------------------------------------------


def test_version_commits_when_every_participant_committed():
    table = VersionTable()
    syncing(table, 1, "a", "b")
    table.report(1, "a", True, "", MEASURED, now=3.0)
    assert table[1].state == State.TRANSFERRING
    v = table.report(1, "b", True, "", None, now=4.0)
    assert (v.state, v.committed, v.finished, table.latest_committed) == (State.COMMITTED, ["a", "b"], 4.0, 1)
    assert v.receivers == {"a": MEASURED}


def test_version_aborts_when_a_participant_failed_naming_each_failure():
    table = VersionTable()
    syncing(table, 1, "a", "b")
    table.report(1, "b", False, "receiver 'b': checksum", None, now=3.0)
    v = table.report(1, "a", True, "", None, now=4.0)
    assert (v.state, v.reason, v.committed) == (State.ABORTED, "b: receiver 'b': checksum", ["a"])
    assert table.latest_committed is None


def test_a_success_after_a_failure_on_an_open_version_clears_it():
    table = VersionTable()
    syncing(table, 1, "a", "b")
    table.report(1, "a", False, "a: transient", None, now=3.0)
    table.report(1, "a", True, "", None, now=3.5)
    v = table.report(1, "b", True, "", None, now=4.0)
    assert (v.state, v.failed) == (State.COMMITTED, {})


def test_a_late_report_never_turns_a_finished_version_around():
    table = VersionTable()
    syncing(table, 1, "a")
    table.report(1, "a", True, "", None, now=3.0)
    v = table.report(1, "a", False, "a: late", None, now=4.0)
    assert v.state == State.COMMITTED


def test_a_failure_of_a_non_participant_is_not_counted():
    table = VersionTable()
    syncing(table, 1, "a")
    table.report(1, "z", False, "z: joined late", None, now=3.0)
    assert table[1].failed == {}


def test_a_failure_before_the_barrier_is_kept_for_it():
    table = VersionTable()
    staged(table, 1)
    table.report(1, "a", False, "a: manifest", None, now=1.5)
    assert table[1].failed == {"a": "a: manifest"} and table[1].state == State.STAGED


def test_report_of_an_unknown_version_is_ignored():
    assert VersionTable().report(5, "a", True, "", None, now=1.0) is None


# -- losing parties -----------------------------------------------------------------------


def test_a_lost_receiver_fails_the_versions_it_has_not_settled():
    table = VersionTable()
    syncing(table, 1, "a", "b")
    table.report(1, "b", True, "", None, now=3.0)
    hit = table.receiver_lost("a", "receiver 'a' silent for 3.1s", now=4.0)
    assert [v.version for v in hit] == [1]
    assert (table[1].state, table[1].reason) == (State.ABORTED, "a: receiver 'a' silent for 3.1s")


def test_a_lost_receiver_that_committed_changes_nothing():
    table = VersionTable()
    syncing(table, 1, "a", "b")
    table.report(1, "a", True, "", None, now=3.0)
    assert table.receiver_lost("a", "gone", now=4.0) == []
    assert table[1].state == State.TRANSFERRING


@pytest.mark.parametrize("keeps_versions", [True, False])
def test_a_lost_sender_aborts_a_version_still_being_written(keeps_versions):
    table = VersionTable()
    table.begin_stage(1, slot0, now=1.0)
    table.sender_lost("sender 'actor-0' died", keeps_versions, now=2.0)
    assert (table[1].state, table[1].reason) == (State.ABORTED, "sender 'actor-0' died")


def test_a_lost_sender_leaves_a_stored_version_to_the_receivers():
    table = VersionTable()
    syncing(table, 1, "a")
    assert table.sender_lost("died", keeps_versions=True, now=3.0) == []
    assert table.report(1, "a", True, "", None, now=4.0).state == State.COMMITTED


def test_a_lost_sender_aborts_a_streamed_version_at_its_barrier():
    table = VersionTable()
    syncing(table, 1, "a")
    table.sender_lost("died", keeps_versions=False, now=3.0)
    assert (table[1].state, table[1].failed) == (State.ABORTED, {"a": "version aborted: died"})


# -- the sender's deadline ----------------------------------------------------------------


def test_expire_before_the_barrier_aborts():
    table = VersionTable()
    staged(table, 1)
    v = table.expire(1, timeout=5.0, now=9.0)
    assert (v.state, v.reason) == (State.ABORTED, "version 1 did not reach the barrier within 5.0s")


def test_expire_at_the_barrier_names_every_receiver_that_did_not_report():
    table = VersionTable()
    syncing(table, 1, "a", "b", "c")
    table.report(1, "a", True, "", None, now=3.0)
    v = table.expire(1, timeout=5.0, now=9.0)
    assert v.state == State.ABORTED
    assert v.failed == {"b": "receiver 'b' did not report version 1 within 5.0s",
                        "c": "receiver 'c' did not report version 1 within 5.0s"}


def test_expire_of_a_finished_version_changes_nothing():
    table = VersionTable()
    syncing(table, 1, "a")
    table.report(1, "a", True, "", None, now=3.0)
    assert table.expire(1, timeout=1.0, now=9.0).state == State.COMMITTED


# -- restart ------------------------------------------------------------------------------


def test_restore_committed_pins_what_a_surviving_receiver_serves():
    table = VersionTable()
    table.restore_committed(4, slot=1, info={"segment": "s"}, now=1.0)
    assert (table[4].state, table[4].slot, table.latest_committed, table.floor) == (State.COMMITTED, 1, 4, 4)
    with pytest.raises(VersionError, match="goes backwards|is reused"):
        table.begin_stage(4, slot0, now=2.0)


# -- what a receiver reads ----------------------------------------------------------------


def test_target_for_a_named_version_waits_until_it_is_readable():
    table = VersionTable()
    table.begin_stage(1, slot0, now=1.0)
    assert table.target_for(None, 1, pipelined=False, keeps_versions=True) is None
    table[1].readable = True
    assert table.target_for(None, 1, pipelined=True, keeps_versions=True) == 1
    table.staged(1, {}, 0.1)
    assert table.target_for(None, 1, pipelined=False, keeps_versions=True) == 1


def test_target_for_an_aborted_version_is_none():
    table = VersionTable()
    staged(table, 1)
    table.abort(1, "x", now=2.0)
    assert table.target_for(None, 1, pipelined=True, keeps_versions=True) is None


def test_target_for_anything_newer_prefers_the_version_on_its_way():
    table = VersionTable()
    syncing(table, 1, "a")
    table.report(1, "a", True, "", None, now=3.0)
    staged(table, 2)
    assert table.target_for(None, None, pipelined=False, keeps_versions=True) == 2
    assert table.target_for(2, None, pipelined=False, keeps_versions=True) is None


def test_late_joiners_catch_up_only_where_the_transport_keeps_versions():
    table = VersionTable()
    syncing(table, 1, "a")
    table.report(1, "a", True, "", None, now=3.0)
    assert table.target_for(None, None, pipelined=False, keeps_versions=True) == 1
    assert table.target_for(None, None, pipelined=False, keeps_versions=False) is None
    assert table.target_for(1, None, pipelined=False, keeps_versions=True) is None


# -- slots --------------------------------------------------------------------------------


def test_slots_pin_in_flight_served_and_latest_committed():
    table = VersionTable()
    syncing(table, 1, "a")
    table.report(1, "a", True, "", None, now=3.0)
    table.begin_stage(2, lambda: 1, now=4.0)
    assert pinned_slots(table, served=[1], keep_previous=True) == {0, 1}
    assert choose_slot({0, 1}, max_slots=3, latest_slot=0) == 2


def test_out_of_slots_gives_up_a_slot_that_is_not_the_latest_committed():
    assert choose_slot({0, 1, 2}, max_slots=3, latest_slot=0) == 1
    assert choose_slot({0, 1}, max_slots=2, latest_slot=None) == 0


# -- broadcast membership -----------------------------------------------------------------


def test_broadcast_group_keeps_its_epoch_while_members_stay():
    groups = BroadcastGroups()
    g1 = groups.form(1, GroupMember("actor-0", 10), [GroupMember("r1", 12, 1), GroupMember("r0", 11, 0)], False, "n")
    assert (g1.epoch, g1.members, g1.size, group_rank(g1, "r1")) == (1, ["r0", "r1"], 3, 2)
    assert groups.form(2, GroupMember("actor-0", 10), [GroupMember("r0", 11, 0), GroupMember("r1", 12, 1)], False, "n").epoch == 1


def test_broadcast_group_re_forms_on_new_members_or_after_a_failed_version():
    groups = BroadcastGroups()
    groups.form(1, GroupMember("actor-0", 10), [GroupMember("r0", 11)], False, "n")
    assert groups.form(2, GroupMember("actor-0", 10), [GroupMember("r0", 13)], False, "n").epoch == 2  # re-registered
    assert groups.form(3, GroupMember("actor-0", 10), [GroupMember("r0", 13)], True, "n").epoch == 3
    assert group_rank(groups.get(3), "r9") is None


def test_a_relay_group_re_forms_when_its_heads_change():
    """Who passes buckets to whom follows the heads (transports/relay/): another count must not
    reuse the pairs of the last one."""
    groups, members = BroadcastGroups(), [GroupMember("r0", 11, 0), GroupMember("r1", 12, 1), GroupMember("r2", 13, 2)]
    assert groups.form(1, GroupMember("actor-0", 10), members, False, "n", heads=2).epoch == 1
    assert groups.form(2, GroupMember("actor-0", 10), members, False, "n", heads=2).epoch == 1
    assert groups.form(3, GroupMember("actor-0", 10), members, False, "n", heads=1).epoch == 2


def test_broadcast_groups_forget_old_versions():
    groups = BroadcastGroups()
    for v in range(1, 12):
        groups.form(v, GroupMember("s", 1), [], False, "n")
    assert sorted(groups.groups) == [3, 4, 5, 6, 7, 8, 9, 10, 11]
