"""What a receiver's wait for its ready words costs: polling (10 .. 250 us sleeps) against a
futex sleep on the word (weightsync/transports/shm/transport.py), on this machine.

A writer process publishes ``--buckets`` ready words, one every ``--gap-ms`` (a sender slower
than the receiver, the case where a receiver waits), stamping CLOCK_MONOTONIC into the word
beside each; a waiter process waits for each word with ``poll_until`` as the shm receiver
does. Reported per mode: the waiter's CPU seconds over the whole run, and how late it saw each
word (its wake-up latency: median, p90, max). Run:

    python benchmarks/notify_wait.py --buckets 104 --gap-ms 5
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from weightsync.transports import Deadline
from weightsync.transports.shm import transport as wake
from weightsync.transports.shm.transport import poll_until

WORDS = 2 * 4096 // 8


def _words(fd: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(fd, WORDS * 8, flags=mmap.MAP_SHARED), dtype=np.uint64)


def waiter(fd: int, buckets: int, futex: bool) -> dict:
    w = _words(fd)
    late = []
    w[-1] = 1  # started (importing torch takes seconds on a loaded machine): the writer may begin
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    for b in range(buckets):
        word = 2 * b
        poll_until(lambda word=word, b=b: int(w[word]) == b + 1, Deadline(0, time.monotonic() + 60), f"bucket {b}",
                   wake.Waiter(w, word) if futex else None, tick=lambda: None)
        late.append(time.monotonic_ns() - int(w[word + 1]))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    late_us = sorted(x / 1e3 for x in late)
    return {"cpu_s": round(cpu, 4), "late_us_median": round(statistics.median(late_us), 1),
            "late_us_p90": round(late_us[int(0.9 * (len(late_us) - 1))], 1), "late_us_max": round(late_us[-1], 1)}


def run(mode: str, buckets: int, gap_s: float) -> dict:
    fd = os.memfd_create("wsync-notify-bench")
    os.ftruncate(fd, WORDS * 8)
    w = _words(fd)
    env = dict(os.environ, WEIGHTSYNC_NOTIFY="futex" if mode == "futex" else "poll")
    child = subprocess.Popen([sys.executable, __file__, "--wait", str(fd), "--buckets", str(buckets), "--mode", mode],
                             pass_fds=(fd,), env=env, stdout=subprocess.PIPE, text=True)
    while int(w[-1]) != 1:
        time.sleep(0.01)
    time.sleep(0.05)  # into its wait for bucket 0
    for b in range(buckets):
        time.sleep(gap_s)
        w[2 * b + 1] = time.monotonic_ns()
        w[2 * b] = b + 1
        wake.wake(w, 2 * b)
    out, _ = child.communicate(timeout=120)
    os.close(fd)
    return {"mode": mode, **json.loads(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", type=int, default=104)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--wait", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="futex", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.wait is not None:
        print(json.dumps(waiter(a.wait, a.buckets, a.mode == "futex")))
        return
    print(f"load {os.getloadavg()[0]:.1f}; {a.buckets} buckets, one every {a.gap_ms} ms")
    for _ in range(a.repeats):
        for mode in ("poll", "futex"):
            print(json.dumps(run(mode, a.buckets, a.gap_ms / 1e3)))
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
