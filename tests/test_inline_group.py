"""Taking over the recipe's inline ``ray.util.collective`` group (weightsync_verl.inline_group),
against Ray's real ``ray.util.collective``.

Ray's ``create_collective_group`` is declarative: it checks the backend and stores the group's
description in a detached actor named ``info_<group>``. So whether a call reached Ray shows
as that actor existing, and the recipe's own call (``backend="nccl"``) fails in Ray here the
way it fails on Ascend: NCCL is not available.
"""

from __future__ import annotations

import inspect

import pytest
from weightsync_verl.inline_group import PARAMS, GroupRequest, take_over_group

GROUP = "actor_rollout"
# Ray's refusal of the recipe's backend here: NCCL unregistered without cupy, or unavailable
NO_NCCL = r"Backend NCCL is (not registered|registered but not available)"


@pytest.fixture(scope="module")
def members(ray_cluster):
    """Two live actors: Ray's function reads their ids."""
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Member:
        def ping(self) -> int:
            return 1

    actors = [Member.remote() for _ in range(2)]
    ray.get([a.ping.remote() for a in actors])
    yield actors
    for a in actors:
        ray.kill(a)


@pytest.fixture
def two_actors(members):
    """(actors, the group names a test let reach Ray): their info actors are removed after."""
    import ray

    made: list[str] = []
    yield members, made
    for group in made:
        try:
            ray.kill(ray.get_actor(f"info_{group}"))
        except ValueError:
            pass


def info_exists(group: str) -> bool:
    import ray

    try:
        ray.get_actor(f"info_{group}")
    except ValueError:
        return False
    return True


def test_ray_signature_is_the_one_requests_are_read_by():
    """request_of names positional arguments by Ray's order: the installed Ray must agree."""
    from ray.util.collective import collective

    params = list(inspect.signature(collective.create_collective_group).parameters)
    assert tuple(params[: len(PARAMS)]) == PARAMS


def test_recipe_call_is_taken_over_inside_the_scope_only(two_actors):
    from ray.util.collective import collective

    actors, made = two_actors
    real = collective.create_collective_group
    taken_over: list[GroupRequest] = []
    # the recipe's call at v0.5.0 (ray_trainer.py, init_workers), positional as it writes it
    recipe_call = (actors, 2, [0, 1])
    with take_over_group(GROUP, taken_over.append) as taken:
        assert collective.create_collective_group is not real
        collective.create_collective_group(*recipe_call, backend="nccl", group_name=GROUP)
    assert (
        taken
        == taken_over
        == [GroupRequest(actors=actors, world_size=2, ranks=[0, 1], backend="nccl", group_name=GROUP)]
    )
    assert not info_exists(GROUP)  # Ray never saw it
    # restored: the same call now reaches Ray, which refuses NCCL on this machine
    assert collective.create_collective_group is real
    with pytest.raises(RuntimeError, match=NO_NCCL):
        collective.create_collective_group(*recipe_call, backend="nccl", group_name=GROUP)


def test_other_groups_pass_through_to_ray(two_actors):
    """Another group's call inside the scope is Ray's: it creates the group's info actor."""
    from ray.util.collective import collective

    actors, made = two_actors
    taken_over: list[GroupRequest] = []
    with take_over_group(GROUP, taken_over.append) as taken:
        made.append("weightsync-test-other")
        collective.create_collective_group(actors, 2, [0, 1], "gloo", "weightsync-test-other")
        with pytest.raises(RuntimeError, match=NO_NCCL):
            collective.create_collective_group(actors, 2, [0, 1], backend="nccl", group_name="weightsync-test-nccl")
        made.append("default")
        collective.create_collective_group(actors, 2, [0, 1], backend="gloo")  # Ray's default name
    assert taken == taken_over == []
    assert info_exists("weightsync-test-other") and info_exists("default")
    assert not info_exists("weightsync-test-nccl")


def test_package_name_is_taken_over_too_and_both_restored_on_error(two_actors):
    """``import ray.util.collective as col; col.create_collective_group`` reaches the same
    replacement; an exception inside the scope still puts both entries back."""
    import ray.util.collective as package
    from ray.util.collective import collective as module

    actors, made = two_actors
    before = (module.create_collective_group, package.create_collective_group)
    taken_over: list[GroupRequest] = []
    with pytest.raises(KeyError, match="inside"):
        with take_over_group(GROUP, taken_over.append):
            package.create_collective_group(actors, 2, [1, 0], "nccl", GROUP)
            raise KeyError("inside")
    assert [r.ranks for r in taken_over] == [[1, 0]]
    assert (module.create_collective_group, package.create_collective_group) == before
    assert not info_exists(GROUP)


def test_an_earlier_replacement_is_what_passes_through_and_comes_back(monkeypatch, two_actors):
    """Something else replaced the entry first (the real-source tier's guard does): other
    groups go to it, and it is the entry again afterwards."""
    from ray.util.collective import collective

    actors, made = two_actors
    seen = []

    def earlier(*args, **kwargs):
        seen.append(kwargs.get("group_name"))

    monkeypatch.setattr(collective, "create_collective_group", earlier)
    with take_over_group(GROUP, lambda request: None):
        collective.create_collective_group(actors, 2, [0, 1], backend="nccl", group_name=GROUP)
        collective.create_collective_group(actors, 2, [0, 1], backend="gloo", group_name="other")
    assert seen == ["other"]
    assert collective.create_collective_group is earlier
