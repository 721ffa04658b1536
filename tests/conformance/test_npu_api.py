"""Every use our code makes of torch_npu, ``torch.npu``, vllm_ascend and vLLM, checked against
the real source of the versions users run, without an NPU and without importing them: the
name exists, and a call's positional count and keyword names are accepted by the signature.
scripts/tiers/conformance.sh downloads the packages (pinned by sha256) and points
WSTEST_CONFORMANCE_DIR at them; without it these tests skip."""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

import pytest
from our_uses import Use, collect
from packaging.version import Version
from source_index import Sym, Tree, dotted_name, stdlib_call

REPO = Path(__file__).resolve().parents[2]
OURS = [REPO / "weightsync", REPO / "integrations" / "verl" / "weightsync_verl",
        REPO / "integrations" / "vllm" / "weightsync_vllm"]
# package -> the versions checked, each a directory <package>-<version> with the package inside:
# the stack docs/index.md installs (torch_npu 2.7.1, vLLM 0.11.0, vllm-ascend 0.11.0rc1) and the
# official Ascend verl image's (vLLM 0.10.1 = commit 38217877aa, vllm-ascend 0.10.0 = 1de16ead8e,
# on the package index as 0.10.0rc1); the weight-transfer API generation: vllm-ascend 0.23.0.post1
# with what it pins (torch_npu 2.10.0.post4, vLLM 0.23.0) and the newest vLLM the vllm-engine tier runs
VERSIONS = {"torch_npu": ["2.7.1", "2.10.0.post4"], "vllm_ascend": ["0.10.0rc1", "0.11.0rc1", "0.23.0.post1"],
            "vllm": ["0.10.1", "0.11.0", "0.23.0", "0.32.0"]}
# our modules that run only from a package version on (the longest matching module prefix
# wins): their uses are checked against those versions and listed as out of scope below them.
# weightsync_vllm is loaded by vLLM's weight-transfer factory, which vLLM has from 0.23 (its
# plugin registers nothing on older ones); its trainer engine is registered only where
# vLLM has trainer engines (WeightTransferTrainerFactory, plugin.py), from 0.32
SCOPES = {"weightsync_vllm": ("vllm", "0.23.0"), "weightsync_vllm.trainer": ("vllm", "0.32.0")}
SOURCES = Path(os.environ.get("WSTEST_CONFORMANCE_DIR", REPO / ".conformance-cache" / "src"))

# skipped in the main run where nothing was downloaded; where the tier names the directory
# (WSTEST_CONFORMANCE_DIR), missing sources fail instead of passing unchecked
needs_sources = pytest.mark.skipif(
    "WSTEST_CONFORMANCE_DIR" not in os.environ
    and not all((SOURCES / f"{p}-{v}" / p).is_dir() for p, vs in VERSIONS.items() for v in vs),
    reason="package sources absent (bash scripts/tiers/conformance.sh downloads them)")


def scope_of(use: Use) -> tuple[str, str] | None:
    """(package, first version) ``use``'s module runs from, or None: every version."""
    keys = [k for k in SCOPES if use.module == k or use.module.startswith(k + ".")]
    return SCOPES[max(keys, key=len)] if keys else None


def in_scope(use: Use, package: str, version: str) -> bool:
    scope = scope_of(use)
    return scope is None or scope[0] != package or Version(version) >= Version(scope[1])


def package_of(symbol: str) -> str:
    return "torch_npu" if symbol.startswith("torch.npu") else symbol.split(".")[0]


@functools.cache
def trees() -> dict[tuple[str, str], Tree]:
    return {(p, v): Tree(SOURCES / f"{p}-{v}", f"{p} {v}") for p, vs in VERSIONS.items() for v in vs}


@functools.cache
def torch_npu_alias(tree: Tree) -> bool:
    """torch_npu makes ``torch.npu`` its own ``torch_npu.npu`` module: the registration must be
    there, and run on ``import torch_npu``: in its __init__ (2.7.1), or in a function that
    __init__'s own code reaches through calls (2.10: _initialize -> _register_components ->
    _register_npu_backend -> register_privateuse1_backend)."""
    calls: dict[str, set[str]] = {}  # function name -> the names it calls (by last part)
    registering: set[str] = set()  # functions holding the registration; "" = a module's top level
    top_level: set[str] = set()  # names torch_npu/__init__.py calls outside any function
    for mod in tree.files:
        if not mod.startswith("torch_npu"):
            continue
        module = tree.ast(mod)
        owner = {id(n): fn.name for fn in ast.walk(module) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(fn)}
        for node in ast.walk(module):
            if not isinstance(node, ast.Call):
                continue
            name = (dotted_name(node.func) or "").rsplit(".", 1)[-1]
            fn = owner.get(id(node), "")
            calls.setdefault(fn, set()).add(name)
            if mod == "torch_npu" and not fn:
                top_level.add(name)
            if name == "_register_device_module":
                args = [a.value if isinstance(a, ast.Constant) else dotted_name(a) for a in node.args]
                if args == ["npu", "torch_npu.npu"]:
                    if mod == "torch_npu" and not fn:
                        return True
                    registering.add(fn)
    seen, todo = set(), set(top_level)
    while todo:
        name = todo.pop()
        if name in registering:
            return True
        seen.add(name)
        todo |= calls.get(name, set()) - seen
    return False


def compiled_evidence(tree: Tree, sym: Sym, use: Use) -> str | None:
    """Names in torch_npu's compiled _C are accepted where torch_npu's own Python uses them the
    same way (same dotted name; a call with as many positional arguments). None: no evidence."""
    parts = sym.name.split(".")
    wanted = ".".join(parts[-2:]) if len(parts) > 1 else parts[0]
    for mod in tree.files:
        for node in ast.walk(tree.ast(mod)):
            d = dotted_name(node.func) if isinstance(node, ast.Call) else dotted_name(node)
            if d and (d == sym.name or d.endswith("." + wanted) or d == wanted):
                if use.call is None or (isinstance(node, ast.Call) and len(node.args) == use.call[0]):
                    return f"{mod}:{node.lineno}"
            if isinstance(node, ast.ImportFrom) and node.module == ".".join(parts[:-1]) and use.call is None:
                if any(a.name == parts[-1] for a in node.names):
                    return f"{mod}:{node.lineno}"
    return None


def compiled_member_evidence(tree: Tree, cls: str, member: tuple[str, ...]) -> str | None:
    """Where the package's own Python builds ``cls(...)`` into a name and uses ``.member`` on it."""
    tail = ".".join(cls.split(".")[-2:])
    for mod, path in tree.files.items():
        text = path.read_text(encoding="utf-8", errors="replace")
        if cls.split(".")[-1] not in text or member[0] not in text:
            continue
        for fn in ast.walk(tree.ast(mod)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            built = {dotted_name(t) for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                     and (dotted_name(n.value.func) or "").endswith(tail) for t in n.targets}
            for n in ast.walk(fn):
                if isinstance(n, ast.Attribute) and n.attr == member[0] and dotted_name(n.value) in built - {None}:
                    return f"{mod}:{n.lineno}"
    return None


def accepts(args: ast.arguments | None, drop_first: bool, where: str, call) -> str | None:
    """Why a call of (positional count, keyword names, star) does not fit, or None."""
    npos, kws, star = call
    if args is None:
        if where.startswith("dataclass:"):
            fields = [f.rstrip("=") for f in where.split(":", 1)[1].split(",") if f]
            required = {f.rstrip("=") for f in where.split(":", 1)[1].split(",") if f and not f.endswith("=")}
            if npos > len(fields):
                return f"takes at most {len(fields)} positional arguments, given {npos}"
            unknown = [k for k in kws if k not in fields]
            missing = required - set(fields[:npos]) - set(kws)
            if unknown or (missing and not star):
                return f"unknown keywords {unknown}, missing {sorted(missing)} (fields {fields})"
            return None
        return f"no signature found ({where or 'not a function or class'})"
    positional = [a.arg for a in args.posonlyargs + args.args][1 if drop_first else 0:]
    if npos > len(positional) and args.vararg is None:
        return f"takes {len(positional)} positional arguments, given {npos}"
    names = positional[npos:] + [a.arg for a in args.kwonlyargs]
    unknown = [k for k in kws if k not in names and k not in [a.arg for a in args.posonlyargs]]
    if unknown and args.kwarg is None:
        return f"no parameter {unknown} (parameters: {positional + [a.arg for a in args.kwonlyargs]})"
    n_default = len(args.defaults)
    required = positional[npos:len(positional) - n_default] if n_default else positional[npos:]
    required += [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    missing = [r for r in required if r not in kws]
    if missing and not star:
        return f"required {missing} not passed"
    return None


def check(tree: Tree, use: Use) -> tuple[str | None, str]:
    """(problem or None, how it was found) for one use against one package version."""
    symbol = use.symbol
    if symbol.startswith("torch.npu"):
        if not torch_npu_alias(tree):
            return "torch_npu does not register torch.npu (torch._register_device_module('npu', torch_npu.npu))", ""
        symbol = "torch_npu.npu" + symbol[len("torch.npu"):]
    sym = tree.find(symbol)
    if sym is None:
        return f"{symbol} does not exist", ""
    if sym.kind == "stdlib" and not use.member:
        why = stdlib_call(sym.name, use.call) if use.call is not None else None
        return (f"{use.what()}{call_text(use.call)}: {why}", sym.name) if why else (None, f"stdlib {sym.name}")
    if sym.kind == "compiled" and use.member:
        ev = compiled_member_evidence(tree, sym.name, use.member)
        return (None, f"compiled; so used by {tree.label} at {ev}") if ev else \
            (f"{use.what()}: compiled, and {tree.label}'s own Python never uses it so", "")
    for i, attr in enumerate(use.member):
        if i == 0:
            inst = tree.returns(sym) if sym.kind == "function" else sym if sym.kind == "class" else \
                tree.mapping_value(sym) if sym.kind == "stdlib" else None
            if inst is None:
                return f"cannot tell what {symbol}(...) builds", sym.name
            sym = Sym("class", inst.name, inst.node, inst.module)
        elif sym.kind == "instance":
            sym = Sym("class", sym.name, sym.node, sym.module)
        if sym.kind == "compiled":
            break
        if sym.kind != "class":
            return f"{use.what()}: cannot follow .{attr} on {sym.name} ({sym.kind})", sym.name
        found = tree.member(sym, attr)
        if found is None:
            outside = tree.bases(sym)[1]
            return f"{sym.name} has no attribute {attr!r}" + (f" (bases outside the source: {outside})"
                                                               if outside else ""), sym.name
        sym = found
    if sym.kind == "compiled":
        ev = compiled_evidence(tree, sym, use)
        return (None, f"compiled; used so by {tree.label} at {ev}") if ev else \
            (f"{sym.name} is compiled and {tree.label}'s own Python never uses it this way", "")
    if use.call is not None and sym.kind != "instance":
        why = accepts(*tree.signature(sym), use.call)
        if why:
            return f"{use.what()}{call_text(use.call)}: {why}", sym.name
    return None, f"{sym.kind} {sym.name}"


def call_text(call) -> str:
    npos, kws, star = call
    return "(" + ", ".join(["_"] * npos + [f"{k}=" for k in kws] + (["*"] if star else [])) + ")"


USES = collect(OURS, REPO)


def test_our_uses_are_found():
    # the collector itself: each package our code drives shows up, else the check below checks nothing
    packages = {package_of(u.symbol) for u in USES}
    assert packages == set(VERSIONS), packages


@needs_sources
@pytest.mark.parametrize("package,version", [(p, v) for p, vs in VERSIONS.items() for v in vs])
def test_every_use_exists_and_fits_the_signature(package, version, capsys):
    tree = trees()[(package, version)]
    problems, lines = [], []
    optional: dict[int, list[tuple[Use, bool]]] = {}
    for use in USES:
        if package_of(use.symbol) != package:
            continue
        label = f"{use.what()}{call_text(use.call) if use.call else ''}"
        if not in_scope(use, package, version):
            lines.append(f"  out of scope ({use.module} runs from {' '.join(scope_of(use))}) {label}  [{use.site}]")
            continue
        if use.guard and tree.find(use.guard) is None:
            lines.append(f"  absent (guarded: our ImportError path) {label}  [{use.site}]")
            continue
        problem, how = check(tree, use)
        if use.optional:
            optional.setdefault(use.group, []).append((use, problem is None))
            lines.append(f"  {'present' if problem is None else 'absent '} (optional) {label}  [{use.site}]")
            continue
        lines.append(f"  {'ok' if problem is None else 'WRONG'}  {label}  [{use.site}] {how}")
        if problem:
            problems.append(f"{package} {version}: {problem}  (our {use.site})")
    for group in optional.values():  # a `getattr(a) or getattr(b)`: one of them must exist
        # a lone hasattr / getattr(x, n, default) is a version switch (plugin.py's, whether
        # vLLM's engines have phases): absent at some releases by design, see the test below
        if len(group) > 1 and not any(ok for _, ok in group):
            names = sorted({u.what() for u, _ in group})
            problems.append(f"{package} {version}: none of {names} exists (our {group[0][0].site})")
    with capsys.disabled():
        print(f"\n{package} {version}: {len(lines)} uses checked against {tree.root}")
        print("\n".join(sorted(set(lines))))
    assert not problems, "\n".join(problems)


@needs_sources
def test_a_lone_optional_lookup_exists_at_some_release():
    """A version switch that no checked release takes is a misspelt name: each lone optional
    lookup must find its name at one release (in scope) of its package at least."""
    groups: dict[int, list[Use]] = {}
    for use in USES:
        if use.optional:
            groups.setdefault(use.group, []).append(use)
    nowhere = []
    for use in (g[0] for g in groups.values() if len(g) == 1):
        package = package_of(use.symbol)
        found = [v for v in VERSIONS[package] if in_scope(use, package, v) and check(trees()[(package, v)], use)[0] is None]
        if not found:
            nowhere.append(f"{use.what()} [{use.site}]: at none of {package} {VERSIONS[package]}")
    assert not nowhere, nowhere


@needs_sources
def test_ipc_handle_layout_matches_torch_npu():
    """What torch_npu's reduce_tensor returns for an NPU tensor is what ipc.wire unpacks:
    (rebuild_npu_tensor, args) with args named and ordered as HANDLE_ARGS."""
    ours = ast.parse((REPO / "weightsync" / "transports" / "ipc" / "wire.py").read_text())
    handle_args = next(ast.literal_eval(n.value) for n in ours.body if isinstance(n, ast.Assign)
                       and any(isinstance(t, ast.Name) and t.id == "HANDLE_ARGS" for t in n.targets))
    for version in VERSIONS["torch_npu"]:
        tree = trees()[("torch_npu", version)]
        rebuild = tree.find("torch_npu.multiprocessing.reductions.rebuild_npu_tensor")
        assert rebuild is not None and rebuild.kind == "function", f"torch_npu {version}: no rebuild_npu_tensor"
        params = tuple(a.arg for a in rebuild.node.args.args)
        assert params == handle_args, f"torch_npu {version}: rebuild_npu_tensor{params}"
        patched = tree.patches("reduce_tensor").get("torch.multiprocessing.reductions.reduce_tensor")
        assert patched is not None, f"torch_npu {version} no longer replaces torch's reduce_tensor"
        reduce_fn = tree.in_module(patched[0], dotted_name(patched[1]))
        shapes = [len(r.value.elts[1].elts) for r in ast.walk(reduce_fn.node)
                  if isinstance(r, ast.Return) and isinstance(r.value, ast.Tuple)
                  and dotted_name(r.value.elts[0]) == "rebuild_npu_tensor"]
        assert shapes == [len(handle_args)], f"torch_npu {version}: {reduce_fn.name} returns {shapes} arguments"


BROKEN = '''
import torch
import torch_npu
from vllm.distributed.utils import StatelessProcessGroup


def f(device, t, store):
    torch.npu.current_stream(device).synchronise()
    torch_npu.get_npu_format(t, 29)
    StatelessProcessGroup(rank=0, world_size=1, store=store, sock=None)
'''


@needs_sources
def test_a_misspelt_name_or_a_wrong_signature_fails_naming_symbol_and_version(tmp_path):
    pkg = tmp_path / "broken"
    pkg.mkdir()
    (pkg / "calls.py").write_text(BROKEN)
    found = {}
    for use in collect([pkg], tmp_path):
        for (package, version), tree in trees().items():
            if package_of(use.symbol) == package:
                problem, _ = check(tree, use)
                if problem:
                    found.setdefault(use.what(), []).append(f"{package} {version}: {problem}")
    assert found.keys() == {"torch.npu.current_stream().synchronise", "torch_npu.get_npu_format",
                            "vllm.distributed.utils.StatelessProcessGroup"}, found
    assert "torch_npu 2.7.1: torch_npu.npu.streams.Stream has no attribute 'synchronise'" in \
        found["torch.npu.current_stream().synchronise"][0]
    assert "takes 1 positional arguments, given 2" in found["torch_npu.get_npu_format"][0]
    assert [p.split(":")[0] for p in found["vllm.distributed.utils.StatelessProcessGroup"]] == \
        [f"vllm {v}" for v in VERSIONS["vllm"]]
    assert all("unknown keywords ['sock']" in p for p in found["vllm.distributed.utils.StatelessProcessGroup"])


GUARDED = '''
def newest_only():
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    return LAYERWISE_INFO.get(None)


def everywhere():
    from vllm.distributed.utils import StatelessProcessGroup
    return StatelessProcessGroup
'''


def test_an_import_under_try_except_importerror_is_a_version_switch(tmp_path):
    pkg = tmp_path / "switch"
    pkg.mkdir()
    (pkg / "calls.py").write_text(GUARDED)
    guards = {u.what(): u.guard for u in collect([pkg], tmp_path)}
    layerwise = "vllm.model_executor.model_loader.reload.layerwise.LAYERWISE_INFO"
    assert guards == {layerwise: layerwise, f"{layerwise}.get": layerwise,
                      "vllm.distributed.utils.StatelessProcessGroup": ""}, guards


def test_no_device_api_is_reached_through_a_computed_name():
    """``getattr(torch, device.type).X`` would call torch.npu.X on an NPU without this test
    seeing it: device calls are written out (weightsync/device/registry.py)."""
    hidden = []
    for root in OURS:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and dotted_name(node.func) == "getattr" and len(node.args) >= 2 \
                        and dotted_name(node.args[0]) == "torch" and isinstance(node.args[1], ast.Attribute) \
                        and node.args[1].attr == "type":
                    hidden.append(f"{path.name}:{node.lineno}")
    assert not hidden, hidden


def test_ipc_handle_layout_matches_the_installed_torch_for_cuda():
    """The CUDA side of the same contract, against the torch installed here: ipc.wire passes
    HANDLE_ARGS by keyword to rebuild_cuda_tensor, and unpacks what reduce_tensor returns."""
    import inspect

    from torch.multiprocessing import reductions

    from weightsync.transports.ipc.wire import HANDLE_ARGS

    assert tuple(inspect.signature(reductions.rebuild_cuda_tensor).parameters) == HANDLE_ARGS
    source = ast.parse(inspect.getsource(reductions.reduce_tensor))
    shapes = [len(r.value.elts[1].elts) for r in ast.walk(source) if isinstance(r, ast.Return)
              and isinstance(r.value, ast.Tuple) and dotted_name(r.value.elts[0]) == "rebuild_cuda_tensor"]
    assert shapes == [len(HANDLE_ARGS)], shapes
