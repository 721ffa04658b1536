"""Taking over one named ``ray.util.collective`` group while a block of code runs.

verl's one-step-off recipe at v0.5.0 and v0.5.0-80 (796871d7, the official Ascend image's
verl) has no method that builds its sync group: ``OneStepOffRayTrainer.init_workers()`` does
it inline, ``from ray.util.collective import collective`` then
``collective.create_collective_group(workers, n, ranks, backend="nccl", group_name="actor_rollout")``,
and syncs right after. The name is looked up on the module at call time, so replacing the
module's entry for the duration of ``init_workers()`` reaches that call and nothing after it.

Only the named group is taken over; a call for any other group goes to whatever the entry
held before (Ray's function, unless something else replaced it first), with its arguments
untouched. Both places a caller can look the function up are replaced and restored:
``ray.util.collective.collective`` (the recipe's) and the package ``ray.util.collective``,
which re-exports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

ENTRY = "create_collective_group"
# ray.util.collective.collective.create_collective_group's leading parameters, in order
PARAMS = ("actors", "world_size", "ranks", "backend", "group_name")


@dataclass(frozen=True)
class GroupRequest:
    """What the recipe asked Ray for, by the names of Ray's parameters."""

    actors: list[Any]
    world_size: int
    ranks: list[int]
    backend: str
    group_name: str


def _namespaces() -> list[Any]:
    # the package re-exports the module's function: either name may be the one looked up
    import ray.util.collective as package
    from ray.util.collective import collective as module

    return [module, package]


def request_of(args: tuple, kwargs: dict) -> GroupRequest:
    """The call's arguments by name, in the order of Ray's signature (PARAMS; the unit test
    holds it against the installed Ray) with Ray's defaults."""
    got = {**dict(zip(PARAMS, args)), **kwargs}
    backend = got.get("backend", "nccl")
    return GroupRequest(
        actors=list(got.get("actors") or []),
        world_size=int(got.get("world_size", 0)),
        ranks=list(got.get("ranks") or []),
        backend=str(getattr(backend, "value", backend)).lower(),
        group_name=str(got.get("group_name", "default")),
    )


@contextlib.contextmanager
def take_over_group(group_name: str, create: Callable[[GroupRequest], None]) -> Iterator[list[GroupRequest]]:
    """While the block runs, ``create_collective_group(..., group_name=group_name)`` calls
    ``create(request)`` instead of Ray; any other group passes through. Yields the list of
    requests taken over (so the caller can tell whether the group was asked for at all).
    The entries are put back as they were on leaving, also on an exception."""
    taken: list[GroupRequest] = []

    def replacement(previous: Callable[..., Any]) -> Callable[..., Any]:
        def create_collective_group(*args: Any, **kwargs: Any) -> Any:
            request = request_of(args, kwargs)
            if request.group_name != group_name:
                return previous(*args, **kwargs)
            taken.append(request)
            return create(request)

        create_collective_group.__wrapped__ = previous  # type: ignore[attr-defined]
        return create_collective_group

    saved = [(space, getattr(space, ENTRY)) for space in _namespaces()]
    for space, previous in saved:
        setattr(space, ENTRY, replacement(previous))
    try:
        yield taken
    finally:
        for space, previous in saved:
            setattr(space, ENTRY, previous)
