"""partial_parity.assign_versions: the per-token layout of versions that the fully-async
parity check accepts, on hand-made differences (0.0: the token matches that version's
weights, 1.0: it does not)."""

from __future__ import annotations

import torch
from partial_parity import assign_versions

B = 1e-4


def diffs(**per_version: str) -> dict[int, torch.Tensor]:
    """v3="0011": under version 3 tokens 0, 1 match and 2, 3 do not."""
    return {int(k[1:]): torch.tensor([float(c) for c in s]) for k, s in per_version.items()}


def test_one_version():
    assert assign_versions(diffs(v2="000"), 2, 2, B) == [2, 2, 2]
    assert assign_versions(diffs(v2="010"), 2, 2, B) is None


def test_an_older_prefix_then_the_newer_version():
    assert assign_versions(diffs(v0="0011", v1="1100"), 0, 1, B) == [0, 0, 1, 1]


def test_versions_never_go_back():
    assert assign_versions(diffs(v0="1001", v1="0110"), 0, 1, B) is None


def test_the_last_token_is_the_newest_version():
    """verl never aborts the last attempt, and it yields at least one token."""
    assert assign_versions(diffs(v0="000", v1="111"), 0, 1, B) is None


def test_a_version_may_contribute_no_token():
    """Aborted before its first token (waiting in vLLM's queue at the sync)."""
    assert assign_versions(diffs(v0="11", v1="00"), 0, 1, B) == [1, 1]
    assert assign_versions(diffs(v0="011", v1="111", v2="100"), 0, 2, B) == [0, 2, 2]


def test_tokens_stay_on_the_newest_version_that_explains_them():
    assert assign_versions(diffs(v0="000", v1="100"), 0, 1, B) == [0, 1, 1]
