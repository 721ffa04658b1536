"""Shared fixtures: one local Ray cluster for the whole run, coordinators with unique names,
and checks that no shared-memory segment or Ray process outlives the tests.

Under pytest-xdist (scripts/test.sh runs the main suite with ``-n 2``) each worker is a session of
its own: its own Ray cluster, its own checks of what it left behind (processes and segments are
told apart by the WSTEST_RUN tag each worker puts in its environment, which every process it
starts inherits), and tests marked ``alone`` run while no other test of the run does. The
reliability table is written once, by the controller, from the scenarios every worker reports.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from weightsync.transports.shm.transport import holders, our_segments, reap_stale

# The tests' simulated accelerator (tests/sim/weightsync_sim) is no part of the package: it registers
# itself as a third-party accelerator would, in every process of the run that imports weightsync,
# Ray's workers and the tests' subprocesses included: they inherit this environment (the
# cluster starts later, in ray_cluster), which puts its folder, and the tests' own for the actor
# classes defined here, on their path and names it for weightsync.device to import
_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE / "sim"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
os.environ["PYTHONPATH"] = os.pathsep.join([str(_HERE / "sim"), str(_HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("WEIGHTSYNC_DEVICE_MODULES", "weightsync_sim")
# this session's tag, inherited by every process it starts (Ray's raylet and workers, the tests'
# subprocesses) and by nothing else: under xdist another worker runs beside it, and another run
# of the suite may too; their processes and segments are not this session's leaks
RUN_TAG = f"{os.getpid()}-{os.urandom(4).hex()}"
os.environ["WSTEST_RUN"] = RUN_TAG


def this_run(me: bool = True) -> list[int]:
    """The pids of this session's live processes: this one and what it started, orphans included
    (a worker whose raylet was killed), by the WSTEST_RUN tag in their environment. Ray's agents
    overwrite theirs with their process title: they are found as their raylet's children (and
    exit with it)."""
    import psutil

    pids = {os.getpid()} if me else set()
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("WSTEST_RUN") == RUN_TAG:
                pids.add(p.pid)
        except (psutil.Error, OSError):
            pass  # gone, a zombie, or another user's
    return sorted(pids)


def pytest_collection_modifyitems(config, items):
    import torch

    from weightsync.device import npu_available

    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_npu = pytest.mark.skip(reason="needs an Ascend NPU with torch_npu")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "npu" in item.keywords and not npu_available():
            item.add_marker(skip_npu)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # logical CPUs only: actors in the tests take num_cpus=0 and share the 2 real cores
    # address "local": a new cluster even where /tmp/ray names one still running (another run,
    # or the other xdist worker: each worker has a cluster of its own, 600 MiB of /dev/shm each)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             object_store_memory=600 * 2**20, runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "0"}})
    yield ray
    ray.shutdown()
    # no Ray process (raylet, GCS, workers) started by this run may outlive it
    import psutil
    from support.parties import wait_until

    def running() -> list:
        # what this session started, orphans included; not the other xdist worker's processes
        pids = {p.pid for p in psutil.Process().children(recursive=True)} | set(this_run(me=False))
        left = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append((pid, " ".join(p.cmdline()[:3])))
            except psutil.NoSuchProcess:
                pass
        return left

    wait_until("every process of this run has exited", lambda: not running(), timeout=20, interval=0.5, strict=False)
    left = running()
    assert not left, f"processes left after ray.shutdown(): {left}"


@pytest.fixture
def coordinator_factory(ray_cluster):
    """make(config_dict) -> Coordinator with a unique name; shut down after the test."""
    from support.parties import new_coordinator

    made = []

    def make(config: dict | None = None, **kwargs):
        made.append(new_coordinator(config, **kwargs))
        return made[-1]

    yield make
    for coord in made:
        coord.shutdown()


@pytest.fixture
def actors(ray_cluster):
    """Track Ray actors a test starts; each is closed (if it can be) and killed afterwards."""
    from support.parties import stop_actors

    started = []

    class Tracker:
        def add(self, handle):
            started.append(handle)
            return handle

    yield Tracker()
    stop_actors(started)


@pytest.fixture
def start_job(coordinator_factory, actors):
    """The one way a test starts a job: start_job(config, receivers=2, manifest=layout("tiny"),
    options=, rollout=, trainer=) -> support.parties.Job (a coordinator with ``config``,
    ``receivers`` rollout workers and a trainer, all given ``config``); torn down after the test."""
    from support.parties import start_parties
    from weightsync_bench.layouts import layout

    def start(config: dict, receivers: int = 2, manifest=None, **kwargs):
        job = start_parties(coordinator_factory(config), manifest or layout("tiny"), config, receivers, **kwargs)
        for party in job.parties:
            actors.add(party)
        return job

    return start


@pytest.fixture(scope="session", autouse=True)
def shm_clean():
    """Fail the run if a test leaves a segment of ours behind: a file in /dev/shm (files
    backing), or a memfd segment still held by a process of this run (memfd backing). Of this
    run: a segment's name carries its creator's pid, and a holder is a process; each counts
    when that process is this session's (this_run): the other xdist worker's segments, in
    flight while this one finishes, and another run's on the same machine are not its leaks."""
    from support.parties import wait_until

    from weightsync.transports.shm.transport import SEGMENT_NAME

    before = set(our_segments()) | {name for _, _, name in holders()}
    yield

    def leftover() -> tuple[set, set]:
        # segment files of processes killed on purpose by fault tests: only those whose creator
        # is gone, so never a live segment of the other worker
        reap_stale()
        pids = set(this_run())
        files = {n for n in set(our_segments()) - before if int(SEGMENT_NAME.match(n).group(1)) in pids}
        held = {(pid, name) for pid, _, name in holders(pids=sorted(pids)) if name not in before}
        return files, held

    wait_until("no segment of this run is left", lambda: not any(leftover()), timeout=10, interval=0.5, strict=False)
    files, held = leftover()
    if files or held:
        pytest.fail(f"segments left after the tests: files in /dev/shm {sorted(files)}, "
                    f"memfds held by live processes {sorted(held)}")


# -- under xdist: tests that must run alone ---------------------------------------------------
# A test marked @pytest.mark.alone measures something node-wide (test_dead_job: the node's
# Shmem) that a test running beside it would move: under xdist it holds a run-wide lock exclusively, and every other test holds it shared, from its first
# fixture's setup to its last one's teardown (a module's job started or closed included). A
# second lock, a turnstile, lets an alone test waiting its turn in before the other worker's next
# test. Serial runs take no lock.


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller, once per worker started: the folder of the run's locks."""
    import tempfile

    config = node.config
    if not hasattr(config, "_wstest_locks"):
        config._wstest_locks = tempfile.mkdtemp(prefix="wstest-locks-")
    node.workerinput["wstest_locks"] = config._wstest_locks


def pytest_unconfigure(config):
    import shutil

    if hasattr(config, "_wstest_locks"):
        shutil.rmtree(config._wstest_locks, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = getattr(item.config, "workerinput", {}).get("wstest_locks")
    if folder is None:
        yield
        return
    import fcntl

    with open(os.path.join(folder, "turnstile"), "a") as turnstile, open(os.path.join(folder, "run"), "a") as run:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(run, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)


# -- the reliability table (docs/reliability.md) is produced from these tests ---------------
# Tests marked @pytest.mark.scenario(kind, name, promise=...) are collected with the
# transport they ran on (their `transport` parameter, else the mark's transport=, else the
# module's CFG) and outcome into results/reliability.json; scripts/reliability_table.py
# renders it (results/reliability.md, docs/reliability.md).

_scenarios: list[dict] = []
_ORDER = pytest.StashKey[int]()


def pytest_configure(config):
    config.addinivalue_line("markers", "scenario(kind, name, promise=, transport=): a fault / bad-input / soak / "
                                       "security case for the reliability table")
    config.addinivalue_line("markers", "alone: runs while no other test of the run does (pytest-xdist: -n 2)")


def pytest_collection_finish(session):
    # the table lists scenarios in collection order, whichever worker ran them and when
    for i, item in enumerate(session.items):
        item.stash[_ORDER] = i


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    mark = item.get_closest_marker("scenario")
    if mark is None or report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    transport = params.pop("transport", None) or mark.kwargs.get("transport") or \
        getattr(item.module, "CFG", {}).get("transport") or "none"
    promise = mark.kwargs.get("promise", "")
    promise = promise.get(transport, "") if isinstance(promise, dict) else promise
    outcome = "skipped" if report.skipped else report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfail" if report.skipped else "xpass"
    # on the report, which xdist carries to the controller: pytest_runtest_logreport collects it there
    report.user_properties.append(("scenario", {
        "kind": mark.args[0], "name": mark.args[1], "transport": transport, "promise": promise,
        "variant": ", ".join(f"{k}={v}" for k, v in params.items()), "outcome": outcome,
        "test": item.nodeid, "seconds": round(report.duration, 2), "order": item.stash.get(_ORDER, 0)}))


def pytest_runtest_logreport(report):
    _scenarios.extend(dict(value) for key, value in report.user_properties if key == "scenario")


def pytest_sessionfinish(session, exitstatus):
    if not _scenarios or hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller writes the table, from every worker's reports
    import importlib.util
    import json
    from pathlib import Path

    root = Path(session.config.rootpath)
    out = root / "results"
    out.mkdir(exist_ok=True)
    # the sim tier's scenarios (-m sim) are the same ones on the simulated accelerator: kept apart;
    # so are the hosts tier's (tests/test_hosts.py, root only), which docs/multinode.md shows
    name = "reliability-sim" if session.config.option.markexpr == "sim" else "reliability"
    if all(r["test"].split("::")[0].endswith("test_hosts.py") for r in _scenarios):
        name = "reliability-hosts"
    _scenarios.sort(key=lambda r: r.pop("order"))  # stable: sorted() keeps a test's setup before its call
    (out / f"{name}.json").write_text(json.dumps(_scenarios, indent=1))
    spec = importlib.util.spec_from_file_location("reliability_table", root / "scripts" / "reliability_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    (out / f"{name}.md").write_text(table.render(_scenarios))
