"""`weightsync bench --trainer-ranks N` (issue 56's one-host measurement) runs tiny: 2 gloo trainer
ranks, 2 receivers, one round; both rows bit-exact and in the JSON. No timing is asserted (the
figures are in results/ and docs/sharded.md)."""

from __future__ import annotations

import json

import pytest

from weightsync.cli import main

pytestmark = pytest.mark.bench  # the bench tier runs them (scripts/tiers/bench.sh)


def test_trainer_ranks_time_gather_and_shards_side_by_side_bit_exact(ray_cluster, tmp_path, capsys):
    out = tmp_path / "ranks.json"
    rc = main(["bench", "--trainer-ranks", "2", "--model", "tiny", "--rounds", "1", "--versions", "1",
               "--warmup", "1", "--json", str(out)])
    assert rc == 0
    top = json.loads(out.read_text())
    assert top["schema"] == "weightsync.bench-ranks/1"
    assert (top["args"]["trainer_ranks"], top["args"]["receivers"], top["args"]["transport"]) == (2, 2, "shm")
    rows = {r["name"]: r for r in top["rows"]}
    assert set(rows) == {"gather", "shards"}
    for r in rows.values():
        assert (r["error"], r["verified"], len(r["seconds"]), len(r["ranks"])) == (None, True, 1, 2)
        assert r["barrier_s"] > 0 and all(x["bound_bytes"] > x["shard_bytes"] > 0 for x in r["ranks"])
    # the shards session was sharded on every rank; the gather one, fed whole tensors, was not
    assert rows["shards"]["sharded"] == [True, True] and rows["gather"]["sharded"] == [False, False]
    assert rows["shards"]["private_within_bound"]  # no rank allocated beyond its shard and two buckets
    assert top["gather_over_shards"] > 0
    assert "gather / shards" in capsys.readouterr().out
