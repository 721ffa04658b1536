"""Shared fixtures: one local Ray cluster for the whole run, coordinators with unique names,
and checks that no shared-memory segment or Ray process outlives the tests."""

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
    # address "local": a new cluster even where /tmp/ray names one still running (another run)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             object_store_memory=600 * 2**20, runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "0"}})
    yield ray
    ray.shutdown()
    # no Ray process (raylet, GCS, workers) started by this run may outlive it
    import psutil
    from support.parties import wait_until

    def running() -> list:
        return [p for p in psutil.Process().children(recursive=True) if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]

    wait_until("every process of this run has exited", lambda: not running(), timeout=20, interval=0.5, strict=False)
    left = running()
    assert not left, f"processes left after ray.shutdown(): {[(p.pid, p.name()) for p in left]}"


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
    backing), or a memfd segment still held by a process of this run (memfd backing)."""
    import time

    import psutil
    from support.parties import wait_until

    started = time.time()
    before = set(our_segments()) | {name for _, _, name in holders()}
    yield

    def this_run() -> list[int]:
        # this process and what it started (Ray's raylet and workers with address "local"), and
        # orphans born since the run began (a worker whose raylet was killed): another test
        # session on the same machine holds memfds of its own, which are not this run's leaks
        me = psutil.Process()
        pids = {me.pid} | {c.pid for c in me.children(recursive=True)}
        for p in psutil.process_iter(["ppid", "create_time"]):
            if p.info["ppid"] == 1 and (p.info["create_time"] or 0) >= started:
                pids.add(p.pid)
        return sorted(pids)

    def leftover() -> tuple[set, set]:
        reap_stale()  # segment files of processes killed on purpose by fault tests
        files = set(our_segments()) - before
        held = {(pid, name) for pid, _, name in holders(pids=this_run()) if name not in before}
        return files, held

    wait_until("no segment of this run is left", lambda: not any(leftover()), timeout=10, interval=0.5, strict=False)
    files, held = leftover()
    if files or held:
        pytest.fail(f"segments left after the tests: files in /dev/shm {sorted(files)}, "
                    f"memfds held by live processes {sorted(held)}")


# -- the reliability table (docs/reliability.md) is produced from these tests ---------------
# Tests marked @pytest.mark.scenario(kind, name, promise=...) are collected with the
# transport they ran on (their `transport` parameter, else the mark's transport=, else the
# module's CFG) and outcome into results/reliability.json; scripts/reliability_table.py
# renders it (results/reliability.md, docs/reliability.md).

_scenarios: list[dict] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "scenario(kind, name, promise=, transport=): a fault / bad-input / soak / "
                                       "security case for the reliability table")


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
    _scenarios.append({"kind": mark.args[0], "name": mark.args[1], "transport": transport, "promise": promise,
                       "variant": ", ".join(f"{k}={v}" for k, v in params.items()), "outcome": outcome,
                       "test": item.nodeid, "seconds": round(report.duration, 2)})


def pytest_sessionfinish(session, exitstatus):
    if not _scenarios:
        return
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
    (out / f"{name}.json").write_text(json.dumps(_scenarios, indent=1))
    spec = importlib.util.spec_from_file_location("reliability_table", root / "scripts" / "reliability_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    (out / f"{name}.md").write_text(table.render(_scenarios))
