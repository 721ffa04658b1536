"""A/B: a sharded shm session's row writers attach the slot's segment with or without
MAP_POPULATE (weightsync/transports/shm/transport.py: attach(populate=...)).

One segment per round of the 0.5B layout's payload size (1.17 GiB), as rank 0 creates it for a
slot's first version; 3 writer processes (ranks 1..3 of 4) each attach it writable and copy their
quarter (300 MiB) into it. The clock of a round: from the writers' start until the last one is
done (the part of a first version in a slot that the attach changes). Rounds alternate
populate / no populate, order flipped every round; a fresh segment every round."""
import json, multiprocessing as mp, os, statistics, sys, time

import torch

from weightsync.config import SyncConfig
from weightsync.transports.shm.transport import attach, create

PAYLOAD = 1_256_000_000  # bytes, about the 0.5B layout's 1.17 GiB
RANKS = 4


def writer(ref: str, directory: str, rank: int, populate: bool, out) -> None:
    t0 = time.perf_counter()
    seg = attach(ref, directory, PAYLOAD, writable=True, populate=populate)
    share = PAYLOAD // RANKS
    src = torch.full((share,), rank, dtype=torch.uint8)
    dst = torch.frombuffer(seg.mm, dtype=torch.uint8, count=share, offset=rank * share)
    dst.copy_(src)
    rss = int([l for l in open("/proc/self/status") if l.startswith("RssShmem")][0].split()[1]) // 1024
    del dst
    seg.close()
    out.put((time.perf_counter() - t0, rss))


def one(populate: bool) -> tuple[float, list[int]]:
    cfg = SyncConfig()
    seg = create(cfg, PAYLOAD, "ab")
    q = mp.get_context("fork").Queue()
    t0 = time.perf_counter()
    procs = [mp.get_context("fork").Process(target=writer, args=(seg.ref, cfg.shm_dir, r, populate, q))
             for r in range(1, RANKS)]
    for p in procs:
        p.start()
    got = [q.get() for _ in procs]
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    seg.close()
    return wall, [m for _, m in got]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    rows = {"populate": [], "no-populate": []}
    rss = {"populate": [], "no-populate": []}
    for i in range(rounds):
        order = ["populate", "no-populate"] if i % 2 == 0 else ["no-populate", "populate"]
        for name in order:
            wall, mib = one(name == "populate")
            rows[name].append(wall)
            rss[name].append(max(mib))
    out = {"schema": "weightsync.ab-shm-writer-attach/1", "payload_bytes": PAYLOAD, "writers": RANKS - 1,
           "machine": os.popen("lscpu | grep 'Model name'").read().split(":")[-1].strip() + f", {os.cpu_count()} cores",
           "load_avg": os.getloadavg(),
           "rows": {k: {"seconds": v, "median": statistics.median(v), "min": min(v), "max": max(v),
                        "writer_rss_shmem_mib_max": max(rss[k])} for k, v in rows.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
