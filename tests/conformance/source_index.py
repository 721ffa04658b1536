"""A third-party package's Python source, read with ``ast`` and never imported: where a dotted
name is defined, what a class has (methods, class attributes, attributes its methods assign on
``self``, inherited ones) and which arguments a function or constructor accepts.

Followed: submodules, ``from x import y [as z]`` (relative too), ``from x import *``, module
attributes assigned from elsewhere in the package (``torch_npu.get_npu_format = patched``,
torch_npu's own patches), bases defined in the package, dataclass fields, the class a function
returns (its annotation, else the class its ``return`` statements construct). What lives only in
compiled code (torch_npu._C) is "compiled": the caller decides what evidence it accepts."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class Sym:
    kind: str  # module | class | function | value | compiled | stdlib (a standard-library object)
    name: str  # dotted, where it is defined
    node: ast.AST | None = None
    module: str = ""
    bound: bool = False  # a method reached through an instance: its first parameter is taken


class Tree:
    def __init__(self, root: Path, label: str):
        self.root, self.label = Path(root), label
        self.files: dict[str, Path] = {}
        self.compiled: set[str] = set()
        for path in self.root.rglob("*"):
            parts = path.relative_to(self.root).parts
            if path.suffix == ".py":
                mod = ".".join(parts[:-1] if parts[-1] == "__init__.py" else (*parts[:-1], path.stem))
                self.files[mod] = path
            elif path.suffix == ".so":
                self.compiled.add(".".join((*parts[:-1], path.name.split(".")[0])))
        self._asts: dict[str, ast.Module] = {}
        self._patches: dict[str, dict[str, tuple[str, ast.AST]]] = {}

    def ast(self, mod: str) -> ast.Module:
        if mod not in self._asts:
            self._asts[mod] = ast.parse(self.files[mod].read_text(encoding="utf-8", errors="replace"))
        return self._asts[mod]

    def is_package(self, mod: str) -> bool:
        return self.files.get(mod, Path()).name == "__init__.py"

    # -- names -------------------------------------------------------------------------------

    def find(self, dotted: str, depth: int = 0) -> Sym | None:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            mod = ".".join(parts[:cut])
            if mod in self.files or mod in self.compiled:
                sym: Sym | None = Sym("module" if mod in self.files else "compiled", mod, module=mod)
                for attr in parts[cut:]:
                    sym = self.attribute(sym, attr, depth + 1) if sym else None
                return sym
        return None

    def attribute(self, sym: Sym, attr: str, depth: int = 0) -> Sym | None:
        if depth > 40:
            return None
        if sym.kind == "compiled":
            return Sym("compiled", f"{sym.name}.{attr}", module=sym.module)
        if sym.kind == "module":
            return self.in_module(sym.name, attr, depth)
        if sym.kind == "class":
            return self.member(sym, attr, depth)
        if sym.kind == "stdlib":
            return Sym("stdlib", f"{sym.name}.{attr}", sym.node, sym.module) \
                if hasattr(stdlib_object(sym.name), attr) else None
        return None

    # -- values typed with the standard library -------------------------------------------------

    def stdlib_typed(self, mod: str, annotation: ast.AST) -> Sym | None:
        """A module value annotated with a standard-library class (vLLM's ``LAYERWISE_INFO:
        WeakKeyDictionary[nn.Module, LayerReloadingInfo]``): its attributes are the real
        class's, read in this Python; the annotation is kept for what ``.get`` returns."""
        d = dotted_name(annotation.value if isinstance(annotation, ast.Subscript) else annotation)
        if not d:
            return None
        head, *rest = d.split(".")
        for node in self._statements(self.ast(mod).body):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                origin = next((f"{node.module}.{a.name}" for a in node.names if (a.asname or a.name) == head), None)
            elif isinstance(node, ast.Import):
                origin = next((a.name for a in node.names if (a.asname or a.name) == head), None)
            else:
                continue
            if origin and origin.split(".")[0] in sys.stdlib_module_names:
                return Sym("stdlib", ".".join([origin, *rest]), annotation, mod)
        return None

    def mapping_value(self, sym: Sym) -> Sym | None:
        """What ``.get(...)`` of a value annotated ``Mapping[K, V]`` returns: a V, where V is a
        class of the package."""
        node = sym.node
        if sym.name.rsplit(".", 1)[-1] != "get" or not isinstance(node, ast.Subscript) \
                or not isinstance(node.slice, ast.Tuple) or len(node.slice.elts) != 2:
            return None
        value = dotted_name(node.slice.elts[1])
        got = self.resolve(sym.module, value) if value else None
        return Sym("instance", got.name, got.node, got.module) if got is not None and got.kind == "class" else None

    def _statements(self, body: list[ast.stmt]):
        for stmt in body:  # top-level, including what sits under if / try (version switches)
            yield stmt
            if isinstance(stmt, (ast.If, ast.Try)):
                yield from self._statements(stmt.body + stmt.orelse + getattr(stmt, "finalbody", []))
                for h in getattr(stmt, "handlers", []):
                    yield from self._statements(h.body)

    def absolute(self, mod: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = mod.split(".") if self.is_package(mod) else mod.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def in_module(self, mod: str, name: str, depth: int = 0) -> Sym | None:
        if mod not in self.files:
            return None
        found: Sym | None = None
        for stmt in self._statements(self.ast(mod).body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                found = Sym("function", f"{mod}.{name}", stmt, mod)
            elif isinstance(stmt, ast.ClassDef) and stmt.name == name:
                found = Sym("class", f"{mod}.{name}", stmt, mod)
            elif isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                found = self.value(mod, name, stmt.value, depth)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                found = self.stdlib_typed(mod, stmt.annotation) or self.value(mod, name, stmt.value, depth)
            elif isinstance(stmt, ast.ImportFrom):
                src = self.absolute(mod, stmt)
                for a in stmt.names:
                    if a.name == "*" and src != mod and found is None:
                        found = self.in_module(src, name, depth + 1) if name != "__all__" else None
                    elif (a.asname or a.name) == name:
                        found = self.find(f"{src}.{a.name}", depth + 1) or found
            elif isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.asname == name:
                        found = self.find(a.name, depth + 1)
                    elif a.asname is None and a.name.split(".")[0] == name:
                        found = self.find(name, depth + 1)
            if found is not None and found.kind != "value":
                return found
        if found is not None:
            return found
        if f"{mod}.{name}" in self.files or f"{mod}.{name}" in self.compiled:
            return self.find(f"{mod}.{name}", depth + 1)
        patched = self.patches(f"{mod}.{name}").get(f"{mod}.{name}")
        if patched is not None:
            return self.value(patched[0], name, patched[1], depth)
        return None

    def resolve(self, mod: str, dotted: str, depth: int = 0) -> Sym | None:
        """A dotted name as written in module ``mod``: its first part bound there, else absolute."""
        head, *rest = dotted.split(".")
        sym = self.in_module(mod, head, depth + 1) if head else None
        if sym is None:
            return self.find(dotted, depth + 1)
        for attr in rest:
            sym = self.attribute(sym, attr, depth + 1) if sym else None
        return sym

    def value(self, mod: str, name: str, node: ast.AST | None, depth: int) -> Sym:
        """What an assignment binds: an alias of another name where it is one."""
        dotted = dotted_name(node) if node is not None else None
        if dotted and depth < 30:
            head = dotted.split(".")[0]
            if head != name:
                target = self.in_module(mod, head, depth + 1)
                if target is not None:
                    rest = dotted.split(".")[1:]
                    for attr in rest:
                        target = self.attribute(target, attr, depth + 1) if target else None
                    if target is not None:
                        return target
                else:
                    target = self.find(dotted, depth + 1)
                    if target is not None:
                        return target
        if isinstance(node, ast.Name):  # a function defined inside another (a patch installer's)
            for sub in ast.walk(self.ast(mod)):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name == node.id:
                    return Sym("function", f"{mod}.<nested>.{node.id}", sub, mod)
        return Sym("value", f"{mod}.{name}", node, mod)

    def patches(self, dotted: str | None = None) -> dict[str, tuple[str, ast.AST]]:
        """``pkg.mod.attr = value`` statements in the package's files that mention ``dotted``'s
        last name as an assignment target: dotted target -> (module, value)."""
        key = (dotted or "").rsplit(".", 1)[-1]
        if key not in self._patches:
            found: dict[str, tuple[str, ast.AST]] = {}
            for mod, path in self.files.items():
                text = path.read_text(encoding="utf-8", errors="replace")
                if f".{key} =" not in text and f".{key}=" not in text:
                    continue
                try:
                    tree = self.ast(mod)
                except SyntaxError:
                    continue
                for node in ast.walk(tree):
                    if isinstance(node, ast.Assign):
                        for t in node.targets:
                            d = dotted_name(t) if isinstance(t, ast.Attribute) else None
                            if d and d.endswith("." + key) and not d.startswith("self."):
                                found.setdefault(d, (mod, node.value))
            self._patches[key] = found
        return self._patches[key]

    # -- classes ------------------------------------------------------------------------------

    def bases(self, cls: Sym) -> tuple[list[Sym], list[str]]:
        """(bases defined in the package, bases from elsewhere by name)."""
        inside, outside = [], []
        for b in cls.node.bases:
            d = dotted_name(b)
            if not d or d == "object":
                continue
            sym = self.resolve(cls.module, d)
            if sym is not None and sym.kind == "class":
                inside.append(sym)
            else:
                outside.append(d)
        return inside, outside

    def member(self, cls: Sym, name: str, depth: int = 0) -> Sym | None:
        assigned: Sym | None = None
        for stmt in cls.node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return Sym("function", f"{cls.name}.{name}", stmt, cls.module, bound=not is_static(stmt))
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return Sym("class", f"{cls.name}.{name}", stmt, cls.module)
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                return Sym("value", f"{cls.name}.{name}", stmt.value, cls.module)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                return Sym("value", f"{cls.name}.{name}", stmt.value, cls.module)
        for fn in cls.node.body:  # attributes the methods set on self
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    targets = node.targets if isinstance(node, ast.Assign) else \
                        [node.target] if isinstance(node, ast.AnnAssign) else []
                    for t in targets:
                        if isinstance(t, ast.Attribute) and dotted_name(t) == f"self.{name}" and assigned is None:
                            value = node.value if node.value is not None else None
                            assigned = self.instance_value(cls.module, value)
                            assigned = assigned or Sym("value", f"{cls.name}.{name}", value, cls.module)
        if assigned is not None:
            return assigned
        if depth < 20:
            for base in self.bases(cls)[0]:
                got = self.member(base, name, depth + 1)
                if got is not None:
                    return got
        return None

    def instance_value(self, mod: str, node: ast.AST | None) -> Sym | None:
        """The class whose instance ``node`` builds (``Cls(...)``), as an instance; else None."""
        if isinstance(node, ast.Call):
            d = dotted_name(node.func)
            if d:
                sym = self.resolve(mod, d)
                if sym is not None and sym.kind == "class":
                    return Sym("instance", sym.name, sym.node, sym.module)
        return None

    def returns(self, fn: Sym) -> Sym | None:
        """The class of what function ``fn`` returns: its annotation, else its return statements'."""
        node = fn.node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.returns is not None:
                d = dotted_name(node.returns) if not isinstance(node.returns, ast.Constant) else node.returns.value
                if isinstance(d, str):
                    got = self.value(fn.module, "", ast.parse(d, mode="eval").body, 0)
                    if got.kind == "class":
                        return Sym("instance", got.name, got.node, got.module)
            for sub in ast.walk(node):
                if isinstance(sub, ast.Return):
                    got = self.instance_value(fn.module, sub.value)
                    if got is not None:
                        return got
        return None

    def signature(self, sym: Sym) -> tuple[ast.arguments | None, bool, str]:
        """(arguments, drop the first parameter?, where) of a function, or of a class's
        constructor (``__init__``, else ``__new__``, else dataclass fields -> None with where
        'dataclass:<fields>')."""
        if sym.kind == "function":
            return sym.node.args, sym.bound, sym.name
        if sym.kind == "class":
            for method in ("__init__", "__new__"):
                m = self.member(sym, method)
                if m is not None and m.kind == "function":
                    return m.node.args, True, m.name
            if any("dataclass" in (dotted_name(d.func if isinstance(d, ast.Call) else d) or "")
                   for d in sym.node.decorator_list):
                fields = []
                for stmt in sym.node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        if "ClassVar" not in ast.unparse(stmt.annotation):
                            fields.append((stmt.target.id, stmt.value is not None))
                return None, False, "dataclass:" + ",".join(f"{n}{'=' if d else ''}" for n, d in fields)
        return None, False, ""


def stdlib_object(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def stdlib_call(dotted: str, call: tuple[int, tuple[str, ...], bool]) -> str | None:
    """Why a call of (positional count, keyword names, star) does not fit the standard-library
    callable ``dotted`` (a method: its ``self`` is taken), or None."""
    npos, kws, star = call
    fn = stdlib_object(dotted)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: nothing to hold the call against
    first = [None] if "." in dotted and inspect.isclass(stdlib_object(dotted.rsplit(".", 1)[0])) else []
    try:
        (sig.bind_partial if star else sig.bind)(*first, *[None] * npos, **dict.fromkeys(kws))
    except TypeError as exc:
        return str(exc)
    return None


def is_static(fn: ast.FunctionDef) -> bool:
    return any(dotted_name(d) == "staticmethod" for d in fn.decorator_list)


def dotted_name(node: ast.AST | None) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None
