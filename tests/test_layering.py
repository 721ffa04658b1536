"""The package's shape, as the architecture promises it: imports only go down, with no cycle (every
import counts: at module level, inside functions, under ``if TYPE_CHECKING``); no module of the
package is imported by a string; every control operation declared once: one request record, one
reply record, one handler found by the request's type, no coordinator call or dispatch named by a
string; and every module outside the public surface marked internal. How long a module is, is
its one job's business."""

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


def imports(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """Modules of the package that ``name`` imports anywhere in its text, with the line of the
    first such import. A late import inside a function is a cycle all the same: it only moves
    the failure from import time to the first call, and hides the dependency from a reader.
    ``from pkg import sub`` depends on ``pkg.sub``; ``from pkg import Name`` on ``pkg``."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            if t in known and t != name:
                found.setdefault(t, node.lineno)
    return found


def cycles_of(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk, as the modules along it."""
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
    return [c for c in cycles if not any(b.startswith(a + ".") for a, b in zip(c, c[1:]))]


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    where = [" -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}"
             for c in cycles_of(graph)]
    assert where == []


def test_a_function_level_import_closes_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f  # late, as a cycle hides\n    return f\n")
    mods = {"pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    graph = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    assert cycles_of(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


# the modules that load a module by a string, and what they load: never one of the package
LOADS_BY_NAME = {
    "weightsync/device/registry.py": "the modules WEIGHTSYNC_DEVICE_MODULES names",
    "weightsync/transports/__init__.py": "the module a plugin names to the deprecated register_transport",
    "weightsync/transports/ipc/wire.py": "torch's (torch_npu's) rebuild functions, from an allowlist",
    "weightsync/transports/broadcast/communicators.py": "torch_npu's and vLLM's communicators, where installed",
}


def test_no_module_of_the_package_is_imported_by_a_string():
    """Wiring by strings hides what depends on what: the package's modules import each other
    by name (a late import inside a function where a dependency must wait for first use). Only
    modules of other packages are loaded by a string, in the places listed."""
    found = {str(path.relative_to(ROOT)) for path in PKG.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__")}
    assert found <= set(LOADS_BY_NAME), sorted(found - set(LOADS_BY_NAME))


# the public surface (docs/api.md): the package, its errors, the transport and accelerator plugin
# interfaces and ``python -m weightsync``; every other module says "Internal." first (PEP 8: an undocumented or
# internal-declared module carries no compatibility promise), so a reader knows at the top line
PUBLIC = {"weightsync/__init__.py", "weightsync/__main__.py", "weightsync/errors.py",
          "weightsync/transports/__init__.py", "weightsync/device/registry.py"}


def marking(path: Path) -> bool:
    """Whether the module's docstring declares it internal."""
    return (ast.get_docstring(ast.parse(path.read_text())) or "").startswith("Internal.")


def test_every_module_outside_the_public_surface_is_marked_internal():
    paths = {str(p.relative_to(ROOT)): p for p in PKG.rglob("*.py")}
    assert PUBLIC <= set(paths)
    wrong = {name: ("public, marked internal" if name in PUBLIC else "internal, not marked")
             for name, p in paths.items() if marking(p) == (name in PUBLIC)}
    assert wrong == {}


def test_an_unmarked_module_is_found(tmp_path):
    (tmp_path / "plain.py").write_text('"""What a plain module does."""\n')
    (tmp_path / "marked.py").write_text('"""Internal. What a marked module does."""\n')
    assert [marking(tmp_path / n) for n in ("plain.py", "marked.py")] == [False, True]


# beside the package, not in it: the benchmark program (benchmarks/weightsync_bench), which only the
# ``weightsync bench`` command reaches, and the tests' support (tests/support), which nothing does
BESIDE = {"weightsync_bench": {"weightsync/cli/__init__.py"}, "support": set()}


def imports_beside(path: Path) -> list[str]:
    """The modules of BESIDE that ``path`` imports, where it may not."""
    where = str(path.relative_to(ROOT))
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [n for n in names if n.split(".")[0] in BESIDE and where not in BESIDE[n.split(".")[0]]]
    return found


def test_the_package_reaches_the_benchmark_only_from_its_command_and_the_tests_never():
    found = {str(p.relative_to(ROOT)): f for p in PKG.rglob("*.py") if (f := imports_beside(p))}
    assert found == {}
    # the check sees such an import: the tests' parties load into the bench's engine
    assert "weightsync_bench.engine" in imports_beside(ROOT / "tests" / "support" / "parties.py")


def test_coordinator_calls_go_through_the_typed_control_plane():
    """A call names its request record, never an op string; nothing dispatches by name."""
    raw = re.compile(r"""\.(call|rpc|_call)\(\s*["']""")
    by_name = re.compile(r"""getattr\([^)]*["']op_|["']op_["']\s*\+""")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in PKG.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if raw.search(line) or by_name.search(line)]
    assert found == []


def test_every_request_has_one_handler_and_every_handler_one_request():
    from weightsync import records
    from weightsync.coordinator.actor import CoordinatorActor

    requests = {c for c in vars(records).values() if isinstance(c, type) and issubclass(c, records.Request)
                and c is not records.Request}
    assert set(records.REQUESTS.values()) == requests  # each one reachable on the wire
    assert set(records.HANDLERS) == requests
    handlers = [fn for fn in vars(CoordinatorActor).values() if fn in records.HANDLERS.values()]
    assert len(handlers) == len(set(handlers)) == len(requests)  # no handler serves two requests
    assert not [n for n in vars(CoordinatorActor) if n.startswith("op_")]


def test_a_second_handler_of_one_request_fails_at_import():
    import pytest

    from weightsync import records

    with pytest.raises(TypeError, match="BeginStage already has a handler"):
        records.handles(records.BeginStage)(lambda self, req: None)


# what a transport publishes for its peers is a typed record (records.py): no ``dict[str, Any]``
# in the signatures through which it passes; the one place a wire dict is taken is where it is
# parsed (the declaration's parsers, on a parameter named ``wire``), the one place it is made a
# record's ``to_wire``
TRANSPORTS = ("shm/transport", "ipc/transport", "ipc/ring", "broadcast/transport", "broadcast/ends",
              "__init__")


def untyped_published(path: Path) -> list[str]:
    """``name(param)`` of every public function and method in ``path`` whose parameter or
    return annotation is a plain ``dict[str, Any]``, other than a parameter named ``wire``."""
    found = []

    def check(fn: ast.FunctionDef, where: str) -> None:
        if (fn.name.startswith("_") and fn.name != "__init__") or fn.name == "to_wire":
            return
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        pairs = [(a.arg, a.annotation) for a in args if a.arg != "wire"] + [("return", fn.returns)]
        found.extend(f"{where}{fn.name}({name})" for name, ann in pairs
                     if ann is not None and "dict[str, Any]" in ast.unparse(ann))

    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            check(node, "")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    check(item, f"{node.name}.")
    return found


def test_transports_publish_typed_records_not_dicts():
    found = [f"{m}: {f}" for m in TRANSPORTS for f in untyped_published(PKG / "transports" / f"{m}.py")]
    assert found == []


def test_a_dict_in_a_transport_signature_is_found(tmp_path):
    (tmp_path / "t.py").write_text(
        "class R:\n"
        "    def __init__(self, ctx, wire: dict[str, Any]): ...\n"
        "    def receive(self, version: int, info: dict[str, Any]) -> None: ...\n"
        "    def _helper(self, info: dict[str, Any]) -> None: ...\n"
        "def session_info() -> dict[str, Any]: ...\n"
        "def to_wire(self) -> dict[str, Any]: ...\n")
    assert untyped_published(tmp_path / "t.py") == ["R.receive(info)", "session_info(return)"]


def test_the_coordinators_process_imports_no_torch():
    # a Ray worker unpickling the actor's class imports the package first: torch there was most of a
    # coordinator's start (1.5 s against 0.4 s on the 2-core VM)
    import subprocess
    import sys

    code = ("import sys\n"
            "from weightsync.config import SyncConfig\n"
            "from weightsync.coordinator.actor import CoordinatorActor\n"
            "CoordinatorActor(SyncConfig.load({'transport': 'shm'}).to_dict(), 'x' * 32)\n"
            "import weightsync\n"
            "assert weightsync.WeightSyncError and weightsync.SyncConfig\n"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[-2] == "[]"
