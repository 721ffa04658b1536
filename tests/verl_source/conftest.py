"""The real-source tier's setup: skipped unless WEIGHTSYNC_VERL_SRC names a verl source tree
(scripts/verl_source.sh makes one and a venv for it); Ray with logical GPUs, since the
recipe's resource pools ask for GPU bundles (nothing here uses a GPU)."""

from __future__ import annotations

import os

import pytest

SRC = os.environ.get("WEIGHTSYNC_VERL_SRC")
HOW = ("set WEIGHTSYNC_VERL_SRC to a verl source tree to run the real-source tier: "
       "scripts/verl_source.sh <tag-or-commit> <dir>, then "
       "WEIGHTSYNC_VERL_SRC=<dir>/src <dir>/venv/bin/python -m pytest -m verl_source tests/verl_source")


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

    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             object_store_memory=600 * 2**20)
    yield ray
    ray.shutdown()
