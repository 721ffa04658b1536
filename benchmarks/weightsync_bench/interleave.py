"""Internal. Runs a size's rows in interleaved rounds (weightsync_bench.rounds) and measures, per row and
round, what a shared machine does to it: the 1-minute load average, the parties' own CPU
seconds (a neighbour stretches wall time far more than the CPU our processes burn) and the
CPU seconds everyone else used meanwhile. With ``--against REV`` a second set of actors runs
that checkout's code, and its transport rows take their turns in the same rounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import ray

from . import progress, rounds
from .fixed_cost import FIXED_COST
from .interrupt import check

# (kind, name, receivers, bucket MiB, checksum, delta), as plan.rows makes them, plus the side
Item = tuple[str, str, int, float | None, bool, str]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (threads included) so far; gone ones count 0."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def machine_busy_seconds() -> float:
    """CPU seconds every core spent on anything but idle / iowait since boot."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class Probe:
    """Around one row: wall time, the parties' CPU seconds, everyone else's, and the load."""

    def __init__(self, pids: list[int]):
        self.pids = pids + [os.getpid()]  # the driver's ray.get loop is part of the row's cost
        self.t0, self.cpu0, self.busy0 = time.monotonic(), cpu_seconds(self.pids), machine_busy_seconds()
        self.load0 = os.getloadavg()[0]

    def done(self, extra_party_cpu_s: float = 0.0) -> dict[str, float]:
        party = cpu_seconds(self.pids) - self.cpu0 + extra_party_cpu_s
        busy = machine_busy_seconds() - self.busy0
        return {"row_wall_s": time.monotonic() - self.t0, "parties_cpu_s": party,
                "others_cpu_s": max(0.0, busy - party), "load_avg_1m": (self.load0 + os.getloadavg()[0]) / 2}


def planned_versions(item: Item, warmup: int, versions: int, barrier_versions: int | None = None,
                     fixed_versions: int = 0) -> int:
    """What a plan item (plan.rows) will move when it runs: the unit of the run's progress."""
    kind = item[0] if item[0] in ("transport", FIXED_COST) else "baseline"
    return versions_run(kind, warmup, versions, barrier_versions, fixed_versions)


def versions_run(kind: str, warmup: int, versions: int, barrier_versions: int | None = None,
                 fixed_versions: int = 0) -> int:
    """Versions a row call moves in all: a sync row adds its pre-staged / prefetched barriers
    (``barrier_versions``, 2 x versions unless a preset says otherwise); a fixed-cost row moves
    its warm-up and ``fixed_versions`` pre-staged barriers."""
    if kind == FIXED_COST:
        return warmup + fixed_versions
    barriers = 2 * versions if barrier_versions is None else barrier_versions
    return warmup + versions + (barriers if kind == "transport" else 0)


# -- the other side of an A/B run -------------------------------------------------------------

def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def extract_rev(rev: str, dest: str | None = None) -> tuple[str, str]:
    """``git archive REV | tar -x`` into a temp dir; (that dir, the rev's short hash). The
    dir holds the rev's ``weightsync`` package, which the other side's actors import first."""
    root = repo_root()
    short = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", rev], check=True, capture_output=True,
                           text=True).stdout.strip()
    tree = dest or tempfile.mkdtemp(prefix=f"wsbench-{short}-")
    archive = subprocess.Popen(["git", "-C", str(root), "archive", rev], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", tree], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"weightsync bench --against {rev}: git archive failed")
    if not (Path(tree) / "weightsync" / "__init__.py").exists():
        raise SystemExit(f"weightsync bench --against {rev}: that tree has no weightsync package")
    return tree, short


def side_runtime_env(tree: str, inherited: str | None = None) -> dict[str, Any]:
    """The other side's actors' env: processes they start import ``weightsync`` from ``tree`` too.
    The driver's own PYTHONPATH follows ``tree``: an env var in a runtime env replaces the
    inherited one, and where Ray itself comes through PYTHONPATH (an offline GPU node with a
    carried Ray) the other side's workers then failed to start ("No module named 'ray'")."""
    inherited = os.environ.get("PYTHONPATH", "") if inherited is None else inherited
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (tree, inherited) if p)}}


def _enter(tree: str) -> str:
    """In a worker of the other side: ``tree`` and its ``benchmarks`` first on sys.path and every
    ``weightsync`` and ``weightsync_bench`` module dropped, so the next import is the rev's. Needed
    because Ray puts the driver's directory (this checkout) at the front of every worker's path,
    ahead of PYTHONPATH, and an installed checkout's import hook would find its own bench."""
    for path in (os.path.join(tree, "benchmarks"), tree):
        if path not in sys.path[:2]:
            sys.path.insert(0, path)
    for name in [m for m in sys.modules if m.split(".")[0] in ("weightsync", "weightsync_bench")]:
        del sys.modules[name]
    import weightsync

    return os.path.dirname(os.path.dirname(os.path.abspath(weightsync.__file__)))


def side_class(tree: str, cls: type) -> type:
    """An actor class that builds the rev's own ``cls`` (same module and name, imported from
    ``tree``) and forwards this checkout's actor protocol (``cls``'s public methods) to it."""
    module, name = cls.__module__, cls.__name__
    if not (Path(tree) / "benchmarks" / "weightsync_bench").is_dir():
        # a revision whose benchmark was still inside the package, as weightsync.bench
        module = module.replace("weightsync_bench.", "weightsync.bench.", 1)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import importlib

        self.weightsync_root = _enter(tree)
        self.inner = getattr(importlib.import_module(module), name)(*args, **kwargs)

    def forward(method: str) -> Callable[..., Any]:
        def call(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.inner, method)(*args, **kwargs)

        call.__name__ = method
        return call

    ns: dict[str, Any] = {m: forward(m) for m in dir(cls) if not m.startswith("_") and callable(getattr(cls, m))}
    ns["__init__"] = __init__
    ns["where"] = lambda self: self.weightsync_root
    return type(f"{name}AtRev", (), ns)


_HOOK = """\
# written by weightsync bench --against: this process imports weightsync from {tree!r}
import importlib.machinery
import sys


class _Side:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return importlib.machinery.PathFinder.find_spec(name, [{tree!r}]) if name == "weightsync" else None


sys.meta_path.insert(0, _Side)
"""


def side_coordinator(tree: str, runtime_env: dict[str, Any]) -> Callable[[dict, str], Any]:
    """``Coordinator.create`` for the other side's rows, made by the other side's code: the
    control protocol between a coordinator and its parties may change from one revision to the
    next (a reply's new field is refused by an older party), so each side's parties talk to a
    coordinator of their own revision. The coordinator's actor is started by that revision's
    ``create``, out of reach of ``_enter``: a ``sitecustomize`` first on its PYTHONPATH (which it
    inherits from the task that makes it) imports ``weightsync`` from the tree in every process
    it starts. Detached: the task ends at once."""
    hook = Path(tree) / ".weightsync-side"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_HOOK.format(tree=tree))
    env = dict(runtime_env.get("env_vars", {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH", "")) if p)

    @ray.remote(num_cpus=0)
    def make(config: dict, name: str) -> Any:
        _enter(tree)
        from weightsync import Coordinator

        return Coordinator.create(config, name=name, detached=True)

    def create(config: dict, name: str) -> Any:
        return ray.get(make.options(runtime_env={**runtime_env, "env_vars": env}).remote(config, name))

    return create


def check_side(bench: Any, tree: str) -> str:
    """Where the other side's actors imported weightsync from; exits unless from ``tree``."""
    got = ray.get(bench.trainer.where.remote(), timeout=300)
    if os.path.realpath(got) != os.path.realpath(tree):
        raise SystemExit(f"weightsync bench --against: the other side's actors import weightsync from {got}, "
                         f"not {tree}")
    return got


# -- the rounds -------------------------------------------------------------------------------

PAST_DEADLINE = "not run: --deadline-s"


def past_deadline(seconds: float) -> str:
    """A row's reason for not running: the run's deadline passed before its turn."""
    return f"{PAST_DEADLINE} {seconds:g} passed before its turn"


def _twins(a: tuple[int, tuple[str, Any]], b: tuple[int, tuple[str, Any]]) -> bool:
    """Whether ``b`` is the --against side's run of ``a``'s row (an A/B pair)."""
    (_, (side_a, item_a)), (_, (side_b, item_b)) = a, b
    return side_a == "this" and side_b == "against" and item_a == item_b


def run_rounds(plan: list[tuple[str, Item]], benches: dict[str, Any], run_row: Callable[[Any, Item], dict],
               refusal: Callable[[Item], str | None], skipped: Callable[[Item, str], dict],
               echo: Callable[[dict, Any], None], *, n_rounds: int, warmup: int, versions: int,
               payload: int, rev: str | None, barrier_versions: int | None = None,
               eta: progress.Eta | None = None,
               deadline: tuple[float, float] | None = None, fixed_versions: int = 0,
               bench_key: Callable[[str, Item], str] | None = None) -> list[dict[str, Any]]:
    """Every (side, item) of ``plan`` once per round, the order rotated each round (an A/B pair
    back to back, which side first alternating: rounds.round_order); returns
    one merged row per (side, item) with the statistics over every round's versions.
    ``eta``: the run's estimate, advanced by each row's planned versions as it ends.
    ``deadline``: (monotonic time, the seconds asked): a row whose turn comes later is skipped.
    ``bench_key``: which of ``benches`` runs a (side, item) (default: the side's; the fixed-cost
    rows have actors of their own, which hold their own layout); ``fixed_versions``: what a
    fixed-cost row times per round."""
    key_of = bench_key or (lambda side, item: side)
    pids = {key: {"trainer": ray.get(b.trainer.pid.remote()), "rollouts": ray.get([r.pid.remote() for r in b.rollouts])}
            for key, b in benches.items()}
    done: list[dict[str, Any]] = []
    if eta is not None:
        eta.begin()
    for k in range(n_rounds):
        order = rounds.round_order(list(enumerate(plan)), k, twins=_twins)
        print(f"weightsync bench: round {k + 1}/{n_rounds}", file=sys.stderr)
        for position, (index, (side, item)) in enumerate(order):
            check()  # a Ctrl-C that a row's error handling swallowed stops the bench here
            n = item[2]
            key = key_of(side, item)
            bench = benches[key]
            planned = planned_versions(item, warmup, versions, barrier_versions, fixed_versions)
            before = progress.ticked()
            late = deadline is not None and time.monotonic() > deadline[0]
            why = past_deadline(deadline[1]) if late else refusal(item)
            if why:
                row = skipped(item, why)
            else:
                probe = Probe([pids[key]["trainer"], *pids[key]["rollouts"][:n]])
                row = run_row(bench, item)
                # collective baselines run in their own actors, which report their own CPU time
                probe_out = probe.done(row.pop("parties_cpu_s", 0.0) or 0.0)
                row.update(probe_out)
                ran = versions_run(row["kind"], warmup, versions, barrier_versions, fixed_versions) if row.get("seconds") else 0
                row["cpu_s_per_version"] = probe_out["parties_cpu_s"] / ran if ran else None
            row.update(round=k, position=position, plan_index=index)
            rounds.tag_side(row, side, rev if side == "against" else None)
            done.append(row)
            # a row skipped or failed part-way ticked less than planned: the bar stays true to the plan
            progress.advance(planned - (progress.ticked() - before))
            if eta is not None:
                eta.add(planned)
                row["eta_text"] = eta.text()
            echo(row, bench)
            row.pop("eta_text", None)
            if row.get("replaced_actors"):  # new actors, new pids
                b = benches[key]
                pids[key] = {"trainer": ray.get(b.trainer.pid.remote()),
                              "rollouts": ray.get([r.pid.remote() for r in b.rollouts])}
    return rounds.merge_all(done, payload)
