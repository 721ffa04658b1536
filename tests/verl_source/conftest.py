"""The real-source tier's setup: skipped unless WSTEST_VERL_SRC names a verl source tree
(scripts/verl_source.sh makes one and a venv for it). Ray gets the logical resources the
recipe's pools ask for with ``device_name="cpu"``: bundles of {"CPU": 3, "cpu": 1} per rank
(verl's RayResourcePool, max_colocate_count=3), and GPUs for its availability check; nothing
here uses a GPU."""

from __future__ import annotations

import os

import pytest

SRC = os.environ.get("WSTEST_VERL_SRC")
HOW = ("set WSTEST_VERL_SRC to a verl source tree to run the real-source tier: "
       "scripts/verl_source.sh <tag-or-commit> <dir>, then "
       "WSTEST_VERL_SRC=<dir>/src <dir>/venv/bin/python -m pytest -m verl_source tests/verl_source")


def pytest_collection_modifyitems(config, items):
    if SRC:
        return
    skip = pytest.mark.skip(reason=HOW)
    for item in items:
        if "verl_source" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from weightsync_verl.recipe import add_setup_hook

    # every Ray worker installs the patch at start-up, as python -m weightsync_verl.one_step_off arranges
    # address "local": a cluster of its own even where another run's is up on this machine
    ray.init(address="local", num_cpus=16, num_gpus=4, resources={"cpu": 4}, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", object_store_memory=600 * 2**20, runtime_env=add_setup_hook(None))
    yield ray
    ray.shutdown()
