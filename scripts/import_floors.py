"""The import floors of the package. Each top-level module of ``weightsync/`` is a room, and
each folder is one room (its sub-folders included). The floors are the longest chain of imports
(any import: module level, in a function, under ``if TYPE_CHECKING``; the graph
tests/test_layering.py reads, which has no cycle), counted in rooms: a step from one module to
another in the same room does not climb a floor, a step into another room does.

    python scripts/import_floors.py          # the floors, the chain, and the module chain
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_layering import PKG, imports, modules  # noqa: E402

MODS = modules()
GRAPH = {m: imports(m, p, set(MODS)) for m, p in MODS.items()}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and (PKG / parts[1]).is_dir():
        return f"weightsync/{parts[1]}/"
    return module


@cache
def climb(module: str) -> tuple[int, tuple[str, ...]]:
    """The most rooms a chain of imports starting at ``module`` passes through, and that chain."""
    best = (1, (module,))
    for n in sorted(GRAPH[module]):
        rooms, chain = climb(n)
        rooms += room(n) != room(module)
        if rooms > best[0]:
            best = (rooms, (module,) + chain)
    return best


@cache
def depth(module: str) -> int:
    return 1 + max((depth(n) for n in GRAPH[module]), default=0)


def floors() -> tuple[int, tuple[str, ...]]:
    return max((climb(m) for m in MODS), key=lambda x: x[0])


if __name__ == "__main__":
    n, chain = floors()
    print(f"the package: {n} floors: " + " -> ".join(chain))
    print(f"longest chain of modules: {max(depth(m) for m in MODS)}")
