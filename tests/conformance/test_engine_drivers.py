"""Our vLLM worker engines against the real code that builds and drives them, read from its
source (never imported, no NPU): for each vLLM generation, the engine our plugin registers
(weightsync_vllm.plugin.WORKER_ENGINES, picked by whether vLLM's WeightTransferEngine has
start_weight_update) must be what vLLM's factory constructs (``engine_cls(...)`` in
WeightTransferEngineFactory.create_engine), define every abstract method of vLLM's base, and
accept each call the worker makes on ``self.weight_transfer_engine``:

- vLLM 0.23.0 as vllm-ascend 0.23.0.post1's NPUWorker drives it (vllm_ascend/worker/worker.py:
  init_weight_transfer_engine, update_weights -> receive_weights(info, load_weights=...), shutdown)
- vLLM 0.32.0 as its GPU Worker drives it (vllm/v1/worker/gpu_worker.py; vLLM's CPUWorker
  inherits it, and the vllm-engine tier runs that for real)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from source_index import Sym, Tree, dotted_name
from test_npu_api import REPO, accepts, call_text, needs_sources, trees
from weightsync_vllm.plugin import WORKER_ENGINES

BASE = "vllm.distributed.weight_transfer.base.WeightTransferEngine"
FACTORY = "vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory.create_engine"
# vLLM version -> (package, version, worker class) of the real worker that drives the engine
DRIVERS = {
    "0.23.0": ("vllm_ascend", "0.23.0.post1", "vllm_ascend.worker.worker.NPUWorker"),
    "0.32.0": ("vllm", "0.32.0", "vllm.v1.worker.gpu_worker.Worker"),
}
OURS = REPO / "integrations" / "vllm"


def engine_calls(cls: ast.ClassDef) -> list[tuple[str, tuple | None, int]]:
    """(member, call or None for an attribute read, line) for each use the worker class makes
    of its engine: ``self.weight_transfer_engine.m(...)`` and the same through a local name."""
    out = []
    for fn in ast.walk(cls):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = {"self.weight_transfer_engine"}
        for n in ast.walk(fn):
            value = n.value if isinstance(n, (ast.Assign, ast.NamedExpr)) else None
            if value is not None and (dotted_name(value) == "self.weight_transfer_engine" or (
                    isinstance(value, ast.Call) and dotted_name(value.func) == "getattr"
                    and isinstance(value.args[1], ast.Constant) and value.args[1].value == "weight_transfer_engine")):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                names |= {dotted_name(t) for t in targets} - {None}
        parents = {c: p for p in ast.walk(fn) for c in ast.iter_child_nodes(p)}
        for n in ast.walk(fn):
            if isinstance(n, ast.Attribute) and dotted_name(n.value) in names:
                parent = parents.get(n)
                if isinstance(parent, ast.Call) and parent.func is n:
                    star = any(isinstance(a, ast.Starred) for a in parent.args) or any(k.arg is None for k in parent.keywords)
                    call = (len(parent.args), tuple(k.arg for k in parent.keywords if k.arg), star)
                    out.append((n.attr, call, n.lineno))
                elif not (isinstance(parent, ast.Assign) and n in parent.targets):
                    out.append((n.attr, None, n.lineno))
    return out


def constructed_with(tree: Tree) -> tuple:
    """The call create_engine makes of the registered class: ``engine_cls(...)``."""
    fn = tree.find(FACTORY)
    assert fn is not None and fn.kind == "function", f"{tree.label}: no {FACTORY}"
    calls = [n for n in ast.walk(fn.node) if isinstance(n, ast.Call) and dotted_name(n.func) == "engine_cls"]
    assert len(calls) == 1, f"{tree.label}: create_engine builds the engine {len(calls)} times"
    return len(calls[0].args), tuple(k.arg for k in calls[0].keywords if k.arg), False


def abstract_methods(tree: Tree, base: Sym) -> set[str]:
    return {f.name for f in base.node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and any((dotted_name(d) or "").endswith("abstractmethod") for d in f.decorator_list)}


def problems(ours: ast.ClassDef, tree: Tree, driver: Tree, worker: str) -> list[str]:
    """Why the class ``ours`` would not work as ``tree``'s engine driven by ``worker``."""
    base = tree.find(BASE)
    assert base is not None and base.kind == "class", f"{tree.label}: no {BASE}"
    mine = {f.name: f for f in ours.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    attrs = {t.id for s in ours.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)}
    out = [f"{tree.label}: abstract {m} not defined" for m in sorted(abstract_methods(tree, base) - set(mine))]

    def fits(name: str, call: tuple | None, who: str) -> None:
        if name in mine:
            fn = mine[name]
            static = any(dotted_name(d) == "staticmethod" for d in fn.decorator_list)
            why = accepts(fn.args, not static, name, call) if call is not None else None
        elif name in attrs:
            why = None
        else:
            inherited = tree.member(base, name)
            if inherited is None:
                out.append(f"{who}: .{name} is neither ours nor {tree.label}'s base's")
                return
            why = accepts(*tree.signature(inherited), call) if call is not None and inherited.kind == "function" \
                else None
        if why:
            out.append(f"{who}: .{name}{call_text(call)}: {why}")

    fits("__init__", constructed_with(tree), f"{tree.label} create_engine")
    cls = driver.find(worker)
    assert cls is not None and cls.kind == "class", f"{driver.label}: no {worker}"
    calls = engine_calls(cls.node)
    assert calls, f"{driver.label}: {worker} never calls its weight_transfer_engine"
    for name, call, line in calls:
        fits(name, call, f"{driver.label} {worker.rsplit('.', 1)[-1]}:{line}")
    return out


def our_class(version: str) -> tuple[str, ast.ClassDef]:
    tree = trees()[("vllm", version)]
    base = tree.find(BASE)
    phased = tree.member(base, "start_weight_update") is not None  # what plugin.register tests
    module, name = WORKER_ENGINES[phased]
    source = ast.parse((OURS / Path(*module.split("."))).with_suffix(".py").read_text())
    return module, next(c for c in source.body if isinstance(c, ast.ClassDef) and c.name == name)


@needs_sources
@pytest.mark.parametrize("vllm_version", sorted(DRIVERS))
def test_the_engine_our_plugin_registers_fits_the_worker_that_drives_it(vllm_version, capsys):
    package, version, worker = DRIVERS[vllm_version]
    module, cls = our_class(vllm_version)
    # the generations differ: 0.23's worker owns the phases, 0.32's engine does
    assert module == {"0.23.0": "weightsync_vllm.worker_v0_23", "0.32.0": "weightsync_vllm.worker"}[vllm_version]
    driver = trees()[(package, version)]
    found = problems(cls, trees()[("vllm", vllm_version)], driver, worker)
    with capsys.disabled():
        calls = engine_calls(driver.find(worker).node)
        print(f"\n{module}.{cls.name} under {driver.label} {worker}: "
              + ", ".join(f"{n}{call_text(c) if c else ''}" for n, c, _ in calls))
    assert not found, "\n".join(found)


BROKEN = '''
class Phased(WeightTransferEngine):
    def __init__(self, config, vllm_config, device, model):
        pass

    def init_transfer_engine(self, init_info):
        pass

    def receive_weights(self, update_info):
        pass

    def shutdown(self):
        pass
'''


@needs_sources
def test_the_phased_engine_under_the_npu_worker_fails_naming_what_and_where():
    """0.32's engine shape registered on vllm-ascend 0.23: wrong constructor, receive_weights
    without load_weights, trainer_send_weights missing; each named with version and line."""
    broken = ast.parse(BROKEN).body[0]
    found = problems(broken, trees()[("vllm", "0.23.0")], trees()[("vllm_ascend", "0.23.0.post1")],
                     DRIVERS["0.23.0"][2])
    assert found[0] == "vllm 0.23.0: abstract trainer_send_weights not defined", found
    assert found[1] == "vllm 0.23.0 create_engine: .__init__(_, _, _): required ['model'] not passed", found
    receive = [p for p in found if ".receive_weights(" in p]
    assert len(receive) == 2 and all(p.startswith("vllm_ascend 0.23.0.post1 NPUWorker:") for p in receive), found
    assert all("no parameter ['load_weights']" in p for p in receive), found
