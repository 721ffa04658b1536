"""receive_ahead on broadcast with every party on the simulated accelerator (weightsync/sim):
the shadow in device memory, the collective (simccl) and the shadow's copies queued on a
stream and landing late. The same functions as test_receive_ahead.py, so the same promised
outcome each: only the job differs (``device="sim"``, one device per party)."""

from __future__ import annotations

import pytest
import test_receive_ahead as ahead
from faultjob import Job

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def job(ray_cluster):
    j = Job("broadcast", ahead.TINY, bucket_mb=ahead.BUCKET_MB, receive_ahead="on", device="sim")
    yield j
    j.close()


test_versions_travel_before_the_barrier_bit_exact = ahead.test_versions_travel_before_the_barrier_bit_exact
test_corrupt_bucket_ahead_leaves_the_engine_untouched = ahead.test_corrupt_bucket_ahead_leaves_the_engine_untouched
test_sender_killed_ahead_leaves_the_engine_untouched = ahead.test_sender_killed_ahead_leaves_the_engine_untouched
