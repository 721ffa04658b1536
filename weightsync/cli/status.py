"""Internal. ``weightsync status`` and ``weightsync reap``."""

from __future__ import annotations

import argparse
import json


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="weightsync", help="coordinator actor name")
    p.add_argument("--namespace", default="", help="Ray namespace of the coordinator")
    p.add_argument("--token", required=True, help="session token (Coordinator.token)")
    p.add_argument("--address", default="auto", help="Ray cluster address")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run_status(args: argparse.Namespace) -> int:
    import ray

    from ..coordinator.client import Coordinator

    ray.init(address=args.address, namespace=args.namespace or None, logging_level="ERROR")
    try:
        coord = Coordinator.connect(args.name, args.token, {"namespace": args.namespace})
        print(json.dumps(coord.status().as_dict(), indent=2) if args.json else coord.format_status())
    finally:
        ray.shutdown()
    return 0


def add_reap_arguments(p: argparse.ArgumentParser) -> None:
    # memfd segments need no reaping: the kernel frees them with their last holder
    p.add_argument("--dir", default="/dev/shm", help="directory of segment files (shm_backing=files)")


def run_reap(args: argparse.Namespace) -> int:
    from ..transports.shm.transport import reap_stale

    removed = reap_stale(args.dir)
    print(f"removed {len(removed)} stale segment(s)" + "".join(f"\n  {n}" for n in removed))
    return 0
