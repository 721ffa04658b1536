"""The fault scenarios of test_faults.py with every party on the simulated accelerator
(tests/sim/weightsync_sim): device buckets, device digests, loads and event polling that
complete late. The same functions, so the same promised outcome each: only the job differs
(``device="sim"``; broadcast runs the sim device's collective, one device per party)."""

from __future__ import annotations

import pytest
import test_faults
from faultjob import Job

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def job(ray_cluster, transport):
    j = Job(transport, test_faults.MANIFEST, bucket_mb=1 / 16, device="sim")
    yield j
    j.close()


test_corrupted_bucket_is_not_applied = test_faults.test_corrupted_bucket_is_not_applied
test_receiver_killed_at_bucket = test_faults.test_receiver_killed_at_bucket
test_sender_killed_at_bucket = test_faults.test_sender_killed_at_bucket
test_sender_killed_while_staging = test_faults.test_sender_killed_while_staging
