"""Every use our code makes of torch_npu, ``torch.npu``, vllm_ascend and vLLM, collected from
our modules with ``ast`` (never a hand-kept list): imports, attribute chains, calls with their
positional count and keyword names, ``getattr`` / ``hasattr`` (optional: another path exists),
``importlib.import_module("...")``, (module, name) string tables, and the instances our code
holds, followed through annotations (``x: PyHcclCommunicator = ...``), constructor calls and
the return annotation of our own functions."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from source_index import dotted_name

ROOTS = ("torch_npu", "torch.npu", "vllm_ascend", "vllm")


@dataclasses.dataclass(frozen=True)
class Use:
    symbol: str  # the dotted name in the package (a module, function, class or value)
    member: tuple[str, ...] = ()  # attributes taken on an instance of ``symbol`` (what it builds / returns)
    call: tuple[int, tuple[str, ...], bool] | None = None  # (positional count, keyword names, *args / **kw used)
    optional: bool = False  # getattr with a default, hasattr: our code has a path for its absence
    group: int = 0  # optional lookups combined in one expression (a `getattr(..) or getattr(..)`)
    site: str = ""
    # imported under ``try: ... except ImportError``: where this symbol does not exist our code
    # takes its ImportError path (a version switch); where it exists, the use must fit
    guard: str = ""
    module: str = ""  # our module, dotted (weightsync_vllm.trainer): what version scopes are keyed by

    def what(self) -> str:
        return self.symbol + "".join(f"().{m}" if i == 0 else f".{m}" for i, m in enumerate(self.member))


def is_ours(symbol: str) -> bool:
    return any(symbol == r or symbol.startswith(r + ".") for r in ROOTS)


@dataclasses.dataclass(frozen=True)
class Ref:
    symbol: str
    member: tuple[str, ...] = ()
    instance: bool = False

    def attr(self, name: str) -> Ref:
        if self.instance:
            return Ref(self.symbol, (*self.member, name), True)
        return Ref(f"{self.symbol}.{name}")


class Module:
    """One of our modules: its import aliases, tables, functions' return types, classes' attributes."""

    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name
        self.tree = ast.parse(path.read_text())
        self.aliases: dict[str, str] = {}
        self.tables: dict[str, list[tuple[str, ...]]] = {}
        self.functions: dict[str, ast.FunctionDef] = {}
        package = name.rsplit(".", 1)[0] if not path.name == "__init__.py" else name
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{base}.{a.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, node)
        for stmt in self.tree.body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(stmt.value, ast.Dict):
                rows = [tuple(e.value for e in v.elts) for v in stmt.value.values
                        if isinstance(v, ast.Tuple) and all(isinstance(e, ast.Constant) for e in v.elts)]
                target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
                if rows and isinstance(target, ast.Name):
                    self.tables[target.id] = rows


class Collector:
    def __init__(self, module: Module):
        self.m = module
        self.uses: list[Use] = []
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(module.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.guards = guarded_imports(module)

    # -- types --------------------------------------------------------------------------------

    def annotation(self, node: ast.AST | None, scope: dict) -> list[Ref]:
        """Instances named by an annotation (``A | B``, ``Optional``, ``type[A]`` -> the class)."""
        if node is None:
            return []
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return self.annotation(ast.parse(node.value, mode="eval").body, scope)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self.annotation(node.left, scope) + self.annotation(node.right, scope)
        if isinstance(node, ast.Subscript) and dotted_name(node.value) == "type":
            return [Ref(r.symbol) for r in self.annotation(node.slice, scope) if r.instance]
        d = dotted_name(node)
        if d:
            head, *rest = d.split(".")
            base = self.m.aliases.get(head)
            if base:
                return [Ref(".".join([base, *rest]), (), True)]
        return []

    def resolve(self, node: ast.AST, scope: dict) -> list[Ref]:
        if isinstance(node, ast.Name):
            if node.id in scope:
                return scope[node.id] if isinstance(scope[node.id], list) else []  # a table pick
            if node.id in self.m.aliases:
                return [Ref(self.m.aliases[node.id])]
            return []
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return scope.get(f"self.{node.attr}", [])
            return [r.attr(node.attr) for r in self.resolve(node.value, scope)]
        if isinstance(node, ast.Call):
            f = dotted_name(node.func)
            if f and self.m.aliases.get(f.split(".")[0], "").startswith("importlib") and f.endswith("import_module"):
                if node.args and isinstance(node.args[0], ast.Constant):
                    return [Ref(node.args[0].value)]
                return []
            if f == "getattr" and len(node.args) >= 2:
                return self.getattr_refs(node, scope)
            if isinstance(node.func, ast.Name) and node.func.id in self.m.functions and node.func.id not in scope:
                return self.annotation(self.m.functions[node.func.id].returns, scope)
            return [Ref(r.symbol, r.member, True) if not r.instance else Ref(r.symbol, (*r.member, "()"), True)
                    for r in self.resolve(node.func, scope)]
        if isinstance(node, ast.BoolOp):
            return [r for v in node.values for r in self.resolve(v, scope)]
        return []

    def getattr_refs(self, node: ast.Call, scope: dict) -> list[Ref]:
        obj, name = node.args[0], node.args[1]
        if isinstance(name, ast.Constant):
            return [r.attr(name.value) for r in self.resolve(obj, scope)]
        # getattr(importlib.import_module(module), cls) with (module, cls) unpacked from a table row
        if isinstance(obj, ast.Call) and obj.args and isinstance(obj.args[0], ast.Name) and isinstance(name, ast.Name):
            a, b = scope.get(obj.args[0].id), scope.get(name.id)
            if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0]:
                return [Ref(f"{row[a[1]]}.{row[b[1]]}") for row in self.m.tables[a[0]]]
        return []

    # -- scopes -------------------------------------------------------------------------------

    def bind(self, body: list[ast.AST], scope: dict, methods: bool = False) -> dict:
        """Names bound in ``body`` (not in functions or classes nested in it) to what they refer
        to, flow-insensitive: a name also bound to something else (another branch) is not
        followed. With ``methods``, also the ``self.x`` the methods assign."""
        seen: dict[str, list[Ref] | None] = {}
        annotated: set[str] = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and methods:
                inner = self.bind(node.body, dict(scope))
                scope.update({k: v for k, v in inner.items() if k.startswith("self.") and k not in scope})
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for sub in shallow(node):
                if isinstance(sub, ast.AnnAssign):
                    key = dotted_name(sub.target)
                    refs = self.annotation(sub.annotation, scope)
                    if key and refs:
                        scope[key] = refs
                        annotated.add(key)
                elif isinstance(sub, ast.Assign) and len(sub.targets) == 1:
                    t = sub.targets[0]
                    if isinstance(t, ast.Tuple) and isinstance(sub.value, ast.Subscript):
                        table = dotted_name(sub.value.value)
                        if table in self.m.tables:
                            for i, e in enumerate(t.elts):
                                if isinstance(e, ast.Name):
                                    scope[e.id] = (table, i)
                    key = dotted_name(t)
                    if key and key not in annotated:
                        refs = self.resolve(sub.value, scope)
                        seen[key] = refs if refs and seen.get(key, refs) == refs else None
        scope.update({k: v for k, v in seen.items() if v and k not in annotated})
        for k in [k for k, v in seen.items() if not v and k not in annotated]:
            scope.pop(k, None)
        return scope

    def collect(self) -> list[Use]:
        module_scope = self.bind(self.m.tree.body, {})
        self.visit(self.m.tree, module_scope)
        return self.uses

    def visit(self, node: ast.AST, scope: dict) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                self.visit(child, self.bind(child.body, dict(scope), methods=True))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = dict(scope)
                for a in child.args.args + child.args.kwonlyargs:
                    refs = self.annotation(a.annotation, scope)
                    if refs:
                        inner[a.arg] = refs
                self.visit(child, self.bind(child.body, inner))
            else:
                self.emit(child, scope)
                self.visit(child, scope)

    def emit(self, node: ast.AST, scope: dict) -> None:
        site = f"{self.m.path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                target = self.m.aliases.get(a.asname or a.name.split(".")[0], "") if isinstance(node, ast.ImportFrom) \
                    else a.name
                if is_ours(target):
                    self.add(Use(target, site=site))
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value.replace(".", "_").isidentifier()
                for e in node.elts) and node.elts[1].value.isidentifier():
            symbol = f"{node.elts[0].value}.{node.elts[1].value}"
            if is_ours(node.elts[0].value):
                self.add(Use(symbol, site=site))
        elif isinstance(node, ast.Call):
            f = dotted_name(node.func)
            if f in ("getattr", "hasattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                optional = f == "hasattr" or len(node.args) == 3
                parent = self.parents.get(node)
                group = id(parent) if isinstance(parent, (ast.BoolOp, ast.UnaryOp)) else id(node)
                for r in self.resolve(node.args[0], scope):
                    self.add(self.use(r.attr(node.args[1].value), None, site, optional, group))
                return
            star = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
            call = (len(node.args), tuple(k.arg for k in node.keywords if k.arg), star)
            for r in self.resolve(node.func, scope):
                self.add(self.use(r, call, site))
        elif isinstance(node, ast.Attribute):
            parent = self.parents.get(node)
            if isinstance(parent, ast.Attribute) or (isinstance(parent, ast.Call) and parent.func is node):
                return  # part of a longer chain / a call: reported there
            for r in self.resolve(node, scope):
                self.add(self.use(r, None, site))

    def use(self, r: Ref, call, site: str, optional: bool = False, group: int = 0) -> Use | None:
        if r.instance and not r.member and call is None:
            return None  # the instance itself, passed along: its uses are reported where they happen
        return Use(r.symbol, r.member, call, optional, group, site)

    def add(self, use: Use | None) -> None:
        if use is not None and is_ours(use.symbol) and "()" not in use.member:
            guard = next((g for g in self.guards if use.symbol == g or use.symbol.startswith(g + ".")), "")
            self.uses.append(dataclasses.replace(use, guard=guard, module=self.m.name))


CATCHES_IMPORT = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def guarded_imports(module: Module) -> set[str]:
    """What ``module`` imports only inside ``try`` blocks that catch ImportError: the symbols
    our code has a path without. A symbol also imported unguarded in the module is not one."""
    def targets(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names}
        if isinstance(node, ast.ImportFrom):
            return {module.aliases.get(a.asname or a.name, "") for a in node.names} - {""}
        return set()

    guarded: set[str] = set()
    inside: set[int] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Try) and any(
                h.type is None or {dotted_name(t) for t in (h.type.elts if isinstance(h.type, ast.Tuple) else [h.type])}
                & CATCHES_IMPORT for h in node.handlers):
            for stmt in node.body:
                for sub in shallow(stmt):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        guarded |= targets(sub)
                        inside.add(id(sub))
    unguarded = {t for n in ast.walk(module.tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in inside
                 for t in targets(n)}
    return {g for g in guarded - unguarded if is_ours(g)}


def shallow(node: ast.AST):
    """``ast.walk`` that does not enter nested functions, lambdas' bodies or classes."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        if n is node or not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(n))


def collect(roots: list[Path], repo: Path) -> list[Use]:
    out = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            name = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
            out += Collector(Module(path, name)).collect()
    return out
