"""Internal. Which transports there are, and what each says of a placement. Every folder of this package
that declares a ``TRANSPORT`` in its ``__init__.py`` is one (found when a name is first asked for),
so adding a transport is one new folder; a plugin elsewhere calls :func:`register`.

A declaration names the transport, where its sender and receiver are (imported only when it is
chosen, so its optional dependencies are needed only then) and two rules over the placement of
the session's parties (:class:`Facts`, computed by selection.py): ``refuses`` says why an explicit
choice of it cannot serve them, ``auto`` whether ``transport: auto`` should take it, with a rank
(lower first) and the reason status() shows. This module imports nothing of the package, so a
folder's ``__init__.py`` can declare itself without pulling in torch or the coordinator.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import threading
from collections.abc import Callable, Sequence
from typing import Any

COLOCATED, SAME_NODE, REMOTE = "colocated", "same node", "remote"


@dataclasses.dataclass(frozen=True)
class Facts:
    """Where a session's parties are, as a transport's rules read them."""

    sender: Any  # records.Placement
    receivers: Sequence[Any]  # the receivers' Placements, by rank
    where: list[str]  # per receiver: COLOCATED, SAME_NODE or REMOTE
    device: str  # the sender's device type ("cpu", "cuda", ...)
    on_device: str  # the sender's device as people read it ("physical cuda 0", "host")
    node: str  # the sender's node as people read it
    ipc: Any  # records.IpcSupport of the sender
    clash: str | None  # why a device collective cannot hold these ranks (None: it can, or gloo)
    describe: Callable[..., str]  # (*kinds) -> which receivers are placed so
    far: Callable[[], str]  # the other nodes, as people read them

    @property
    def accelerator(self) -> bool:
        return self.device != "cpu"

    @property
    def colocated(self) -> bool:
        return bool(self.where) and all(w == COLOCATED for w in self.where)

    @property
    def same_node(self) -> bool:
        return all(w != REMOTE for w in self.where)


Rank = tuple[int, str]  # (rank: lower is taken first, the reason auto gives)


@dataclasses.dataclass(frozen=True)
class Transport:
    """A transport as its folder (or a plugin) declares it."""

    name: str
    module: str  # defines ``sender`` and ``receiver``: classes, or factories called the same way
    sender: str
    receiver: str
    refuses: Callable[[Facts], str | None] = lambda facts: None
    auto: Callable[[Facts], Rank | None] = lambda facts: None


_declared: dict[str, Transport] = {}
_found = False
_lock = threading.Lock()


def _find() -> dict[str, Transport]:
    """The transports: every folder of this package that declares one, and those registered."""
    global _found
    with _lock:
        if not _found:
            package = importlib.import_module(__package__)
            for info in pkgutil.iter_modules(package.__path__, f"{__package__}."):
                if info.ispkg:
                    declared = getattr(importlib.import_module(info.name), "TRANSPORT", None)
                    if isinstance(declared, Transport) and declared.name not in _declared:
                        _declared[declared.name] = declared
            _found = True
    return _declared


def register(transport: Transport) -> None:
    """Make a transport declared outside this package selectable (every party of a job must).

    Raises:
        ValueError: its name is "auto" or taken.
    """
    known = _find()
    if transport.name == "auto" or transport.name in known:
        raise ValueError(f"transport {transport.name!r} is already registered "
                         f"({known[transport.name].module if transport.name in known else 'reserved'})")
    known[transport.name] = transport


def forget(name: str) -> None:
    """Undo :func:`register` (tests)."""
    _find().pop(name, None)


def names() -> list[str]:
    """Every transport's name, sorted ("auto" is not one)."""
    return sorted(_find())


def get(name: str) -> Transport:
    """The transport ``name``.

    Raises:
        ValueError: none of that name.
    """
    known = _find()
    if name not in known:
        raise ValueError(f"no transport named {name!r}; registered: {', '.join(sorted(known))}")
    return known[name]


def ranked(facts: Facts) -> list[tuple[int, str, str]]:
    """(rank, name, reason) of every transport ``auto`` may take for ``facts``, best first."""
    return sorted((r[0], t.name, r[1]) for t in _find().values() if (r := t.auto(facts)) is not None)
