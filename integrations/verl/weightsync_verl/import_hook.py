"""Run a function on a module right after it executes, wherever it is first imported: how the
adapter puts its mixins in front of the recipe's classes (recipe.install) without importing
the recipe itself, and how the verl end-to-end run applies its CPU shims
(tests/verl_source/e2e_site/sitecustomize.py). Imports nothing outside the standard library,
so a sitecustomize can use it in every process at no cost."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any


class _ThenLoader(importlib.abc.Loader):
    """The module's own loader, followed by ``then(module)``."""

    def __init__(self, inner: Any, then: Callable[[ModuleType], Any]):
        self.inner, self.then = inner, then

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec) if hasattr(self.inner, "create_module") else None

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.then(module)


class AfterImport(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: finds each module named in ``fixes`` through the finders
    after it and wraps its loader, so ``fixes[name](module)`` runs once the module executed."""

    def __init__(self, owner: str, fixes: Mapping[str, Callable[[ModuleType], Any]]):
        self.owner, self.fixes = owner, fixes

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        fix = self.fixes.get(fullname)
        if fix is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _ThenLoader(spec.loader, fix)
                return spec
        return None


def after_import(owner: str, fixes: Mapping[str, Callable[[ModuleType], Any]]) -> AfterImport:
    """Put an :class:`AfterImport` for ``fixes`` first on ``sys.meta_path``, once per ``owner``
    (a second call returns the installed one). Modules imported before are not touched: the
    caller fixes those itself."""
    for finder in sys.meta_path:
        if isinstance(finder, AfterImport) and finder.owner == owner:
            return finder
    finder = AfterImport(owner, fixes)
    sys.meta_path.insert(0, finder)
    return finder


def remove(owner: str) -> None:
    """Take ``owner``'s finder off ``sys.meta_path`` (modules it fixed stay fixed)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, AfterImport) and f.owner == owner)]


def with_mixin(cls: type, mixin: type, home: str) -> type:
    """``cls`` with ``mixin`` in front, its ``__module__`` ``home``; the same class back if it
    already has it."""
    if issubclass(cls, mixin):
        return cls
    return type(cls.__name__, (mixin, cls), {"__module__": home, "__qualname__": f"with_weightsync.{cls.__name__}",
                                            "__doc__": cls.__doc__})


def put_in_front(module: ModuleType, name: str, mixin: type, home: str) -> None:
    """Replace the class ``module.<name>`` by ``with_mixin(cls, mixin, home)``. The original
    stays importable as ``module._weightsync_original_<name>``: Ray pickles the new class by
    value and its bases by reference (by value, v0.6.1's drag unpicklable globals)."""
    cls = getattr(module, name)
    patched = with_mixin(cls, mixin, home)
    if patched is not cls:
        original = f"_weightsync_original_{name}"
        setattr(module, original, cls)
        cls.__qualname__ = original
        setattr(module, name, patched)
