"""The package's shape, as the architecture promises it: no import cycles among module-level
imports, no module over 400 lines outside the benchmark, and no string-named coordinator call
outside the typed control plane."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "weightsync"


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports at module level (not inside functions or
    ``if TYPE_CHECKING``)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    # a package's __init__ importing its own submodules is how packages work, not a cycle
    cycles = [c for c in cycles if not any(b.startswith(a + ".") for a, b in zip(c, c[1:]))]
    assert cycles == []


def test_no_module_over_400_lines_outside_the_benchmark():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
            if "bench" not in p.parts and (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_coordinator_calls_go_through_the_typed_control_plane():
    raw = re.compile(r"""\.(call|rpc|_call)\(\s*["']""")
    allowed = {PKG / "control.py", PKG / "coordinator.py"}
    found = [f"{p.relative_to(ROOT)}:{i}" for p in PKG.rglob("*.py") if p not in allowed
             for i, line in enumerate(p.read_text().splitlines(), 1) if raw.search(line)]
    assert found == []
