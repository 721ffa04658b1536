"""One-off diagnostic: the bench with each link's tbf queue limited to LAT ms (default 10ms) instead of
hostnet's 100 ms (is a deep queue, delaying one direction's ACKs behind the other's data, what slows
the relay on?). Root; from the repository root:
LAT=10ms PYTHONPATH=.:benchmarks python results/hosts-ranks-2026-11-29/tbf_queue.py bench --hosts 4 \
    --link-gbit 1 --trainer-ranks 2x2 --rounds 2 --versions 2 --warmup 1 --json diag-tbf-queue-10ms.json"""
import os, sys
from weightsync_bench import hostnet
LAT = os.environ.get("LAT", "10ms")
def _set_qdiscs(self, host):
    gbit = self.link_gbit[host]
    for where in (("ip", "netns", "exec", self.netns[host], "tc"), ("tc",)):
        dev = "eth0" if len(where) > 1 else self.ports[host]
        rate = int(gbit * 1e9)
        burst = max(64 * 1024, rate // 8 // 250)
        hostnet._sh(*where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", LAT)
hostnet.Cluster._set_qdiscs = _set_qdiscs
from weightsync.cli import main
sys.exit(main(sys.argv[1:]))
