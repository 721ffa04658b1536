"""Receivers on one node share the hashing of shm buckets through a byte-range lock per bucket
word (transports/shm/transport.py). POSIX record locks belong to the process, so with several
hash threads per receiver the kernel's deadlock check reports EDEADLK where no deadlock exists
(four receivers on an H200 node failed a version so). Reproduced here with two processes of two
threads each, in the order the kernel refuses."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

from support.parties import wait_until

# the other receiver: its first thread holds bucket 2's word; on "go" its second thread asks for
# bucket 1's, first with a plain lockf, then with lock_word
OTHER = """
import errno, fcntl, sys, threading
from weightsync.transports.shm.transport import lock_word
fd = open(sys.argv[1], "r+b")
done, holding = threading.Event(), threading.Event()
def hold():
    fcntl.lockf(fd, fcntl.LOCK_EX, 8, 16)
    holding.set()
    done.wait(30)
    fcntl.lockf(fd, fcntl.LOCK_UN, 8, 16)
holder = threading.Thread(target=hold)
holder.start()
holding.wait(30)
print("holding", flush=True)
sys.stdin.readline()
try:
    fcntl.lockf(fd, fcntl.LOCK_EX, 8, 8)
    print("acquired at once", flush=True)
except OSError as exc:
    print("EDEADLK" if exc.errno == errno.EDEADLK else errno.errorcode[exc.errno], flush=True)
    lock_word(fd.fileno(), 1)
    print("acquired by lock_word", flush=True)
fcntl.lockf(fd, fcntl.LOCK_UN, 8, 8)
done.set()
holder.join(30)
"""


def _blocked(pid: int) -> bool:
    # /proc/locks lists a waiter as "N: -> POSIX ADVISORY WRITE <pid> ..."
    return any("-> POSIX" in line and line.split()[5] == str(pid) for line in Path("/proc/locks").read_text().splitlines())


def test_a_false_deadlock_between_hash_threads_is_waited_out(tmp_path):
    path = tmp_path / "segment"
    path.write_bytes(bytes(64))
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", OTHER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    fd = open(path, "r+b")  # noqa: SIM115
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX, 8, 8 * 1)  # our first hash thread holds bucket 1
        assert child.stdout.readline().strip() == "holding"  # the other's first thread holds bucket 2
        waiter = threading.Thread(target=lambda: (fcntl.lockf(fd, fcntl.LOCK_EX, 8, 8 * 2),
                                                  fcntl.lockf(fd, fcntl.LOCK_UN, 8, 8 * 2)))
        waiter.start()  # our second thread waits for bucket 2: the kernel lists it blocked
        wait_until("our second thread blocked on bucket 2", lambda: _blocked(os.getpid()), timeout=30)
        child.stdin.write("go\n")  # the other's second thread asks for bucket 1
        child.stdin.flush()
        first = child.stdout.readline().strip()
        fcntl.lockf(fd, fcntl.LOCK_UN, 8, 8 * 1)  # our first thread's hash is done
        second = child.stdout.readline().strip()
        waiter.join(30)
        assert (first, second, waiter.is_alive(), child.wait(30)) == ("EDEADLK", "acquired by lock_word", False, 0)
    finally:
        fd.close()
        if child.poll() is None:
            child.kill()
            child.wait(10)
