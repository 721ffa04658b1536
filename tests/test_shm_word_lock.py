"""Receivers on one node share the hashing of shm buckets through a byte-range lock per bucket
word (transports/shm/transport.py). POSIX record locks belong to the process, so with several
hash threads per receiver the kernel's deadlock check reports EDEADLK where no deadlock exists
(four receivers on an H200 node failed a version so). Reproduced here with two processes of two
threads each, in the order the kernel refuses."""

from __future__ import annotations

import errno
import fcntl
import multiprocessing as mp
import threading
import time

from weightsync.transports.shm.transport import lock_word


def _other_receiver(path: str, holding, go, done, out) -> None:
    fd = open(path, "r+b")  # noqa: SIM115  (held for the life of this process)
    holder = threading.Thread(target=lambda: (fcntl.lockf(fd, fcntl.LOCK_EX, 8, 8 * 2), holding.set(), done.wait(30),
                                              fcntl.lockf(fd, fcntl.LOCK_UN, 8, 8 * 2)))
    holder.start()
    go.wait(30)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX, 8, 8 * 1)  # the plain call: refused while the first process waits on us
        out.put("acquired at once")
    except OSError as exc:
        out.put("EDEADLK" if exc.errno == errno.EDEADLK else errno.errorcode[exc.errno])
        lock_word(fd.fileno(), 1)
        out.put("acquired by lock_word")
    fcntl.lockf(fd, fcntl.LOCK_UN, 8, 8 * 1)
    done.set()
    holder.join(30)


def test_a_false_deadlock_between_hash_threads_is_waited_out(tmp_path):
    path = tmp_path / "segment"
    path.write_bytes(bytes(64))
    ctx = mp.get_context("spawn")
    holding, go, done, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_other_receiver, args=(str(path), holding, go, done, out))
    child.start()
    fd = open(path, "r+b")  # noqa: SIM115
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX, 8, 8 * 1)  # our first hash thread holds bucket 1
        assert holding.wait(60)  # the other receiver's first thread holds bucket 2
        waiter = threading.Thread(target=lambda: (fcntl.lockf(fd, fcntl.LOCK_EX, 8, 8 * 2),
                                                  fcntl.lockf(fd, fcntl.LOCK_UN, 8, 8 * 2)))
        waiter.start()  # our second thread waits for bucket 2
        time.sleep(0.3)
        go.set()  # the other receiver's second thread asks for bucket 1
        first = out.get(timeout=30)
        time.sleep(0.2)
        fcntl.lockf(fd, fcntl.LOCK_UN, 8, 8 * 1)  # our first thread's hash is done
        second = out.get(timeout=30)
        waiter.join(30)
        child.join(30)
        assert (first, second, waiter.is_alive(), child.exitcode) == ("EDEADLK", "acquired by lock_word", False, 0)
    finally:
        fd.close()
        if child.is_alive():
            child.kill()
