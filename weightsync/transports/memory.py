"""Internal. Host shared-memory segments, mapped by every party of a node. The shm transport keeps
versions in them; the ipc transport's control block and its host bucket buffers are segments too.

Two backings (``shm_backing``):

- **memfd** (``auto`` where it works): memory from ``memfd_create``, named in no file system.
  The kernel frees it when the last fd and mapping are gone, so a job that dies (crash,
  ``ray stop``, SIGKILL) leaves nothing in RAM. The creator publishes ``<name>@<fd>`` (the
  name carries its pid); an attacher opens ``/proc/<pid>/fd/<fd>``, checks that the link names
  that memfd (the pid may have been reused), and keeps its own fd, so it is a holder too:
  when the creator is gone, a late receiver finds the segment through any other holder.
- **files**: named files in ``shm_dir`` (a tmpfs), for platforms without memfd or to inspect
  them. They outlive a dead job until reaped (:func:`reap_stale`: when the next sender starts, or
  ``weightsync reap``).

How segments are found outside the process that made them: the name a creator gives a segment
(its pid and 128 random bits), the reference parties publish (the name, or ``name@fd`` for a
memfd), the /proc link a memfd of that name shows; which live processes hold a memfd segment
(a scan of /proc/<pid>/fd: a late receiver attaches through any holder, and ``weightsync
status`` and the tests' leak checks count them), which segment files sit in a directory, and
reaping the files whose creator died (files backing only: the kernel frees a memfd with its last
holder).

How much memory a node can still give a segment: /proc/meminfo, the memory cgroup's room (shmem
is charged to it), and the free space of a segment directory. A segment is checked against this
before its pages are reserved, so no room is a CapacityError naming the figure, not a SIGBUS
mid-copy (shm's mode and delta's host shadow read the same figure).

How parties wait on a segment's words: they sleep in the kernel on the word itself (a Linux futex
on the shared mapping), and the writer wakes them right after its store (:func:`wake`,
:class:`Waiter`, :func:`poll_until`); where futexes cannot work, short polling sleeps.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import mmap
import os
import platform
import re
import secrets
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import device as devices
from ..errors import CapacityError, ConfigError, ProtocolError

if TYPE_CHECKING:
    from ..config import SyncConfig
    from .base import Deadline

PAGE = 4096


# -- names, references, holders, reaping -------------------------------------------------------

PREFIX = "wsync_"
SEGMENT_NAME = re.compile(r"^wsync_(\d+)_([0-9a-f]{32})$")  # wsync_<creator pid>_<128 random bits>
# what parties publish: the name (files) or name@fd (memfd: the creator's fd number)
SEGMENT_REF = re.compile(r"^(wsync_(\d+)_[0-9a-f]{32})(?:@(\d+))?$")


def segment_name() -> str:
    # 128 random bits: another user or job cannot guess the name; the pid lets a later
    # process reap files whose creator died, and tells an attacher where a memfd lives
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(16)}"


def memfd_link(name: str) -> str:
    """What /proc/<pid>/fd/<fd> reads for a memfd segment of this name."""
    return f"/memfd:{name} (deleted)"


def reap_stale(directory: str = "/dev/shm") -> list[str]:
    """Unlink our segment files whose creating process is gone; returns what was removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        m = SEGMENT_NAME.match(name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # creator alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, someone else's
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def our_segments(directory: str = "/dev/shm") -> list[str]:
    """Segment files (files backing) in ``directory``."""
    try:
        return sorted(n for n in os.listdir(directory) if SEGMENT_NAME.match(n))
    except FileNotFoundError:
        return []


def holders(names: Iterable[str] | None = None, pids: Iterable[int] | None = None) -> list[tuple[int, int, str]]:
    """(pid, fd, segment name) for each fd of a memfd segment of ours open in a live process
    this user may inspect (of ``names`` only, and in ``pids`` only, if given)."""
    want = set(names) if names is not None else None
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()) if pids is None else pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or another user's
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("/memfd:" + PREFIX) and link.endswith(" (deleted)"):
                name = link[len("/memfd:"): -len(" (deleted)")]
                if SEGMENT_NAME.match(name) and (want is None or name in want):
                    found.append((pid, int(fd), name))
    return found


# -- the room a node has ----------------------------------------------------------------------

_UNLIMITED = 1 << 60  # cgroup limits at or above this mean "no limit"


def meminfo(key: str) -> int | None:
    """A /proc/meminfo field in bytes (``MemAvailable``, ``Shmem``), or None (no such field, not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_available() -> tuple[int, str]:
    """Bytes the kernel can still give a memfd segment, and where that figure comes from:
    MemAvailable, or less where this process's memory cgroup is limited (shmem is charged to it)."""
    best = meminfo("MemAvailable")
    best, where = (meminfo("MemFree") or 0) if best is None else best, "MemAvailable"
    headroom = _cgroup_headroom()
    if headroom is not None and headroom < best:
        best, where = headroom, "the memory cgroup's limit"
    return best, where


def _cgroup_headroom() -> int | None:
    try:
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    v2 = next((ln.split("::", 1)[1] for ln in lines if ln.startswith("0::")), None)
    # (limit, usage, stat) files: v2 under its path, v1 at the memory controller's mount
    candidates = [(f"/sys/fs/cgroup{v2}".rstrip("/"), "memory.max", "memory.current", "file", "shmem")] if v2 else []
    candidates.append(("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                       "total_cache", "total_shmem"))
    for base, limit_f, usage_f, cache_key, shmem_key in candidates:
        try:
            with open(f"{base}/{limit_f}", encoding="ascii") as fh:
                raw = fh.read().strip()
            limit = _UNLIMITED if raw == "max" else int(raw)
            with open(f"{base}/{usage_f}", encoding="ascii") as fh:
                usage = int(fh.read())
            with open(f"{base}/memory.stat", encoding="ascii") as fh:
                stat = dict(ln.split() for ln in fh if len(ln.split()) == 2)
        except (OSError, ValueError):
            continue
        if limit >= _UNLIMITED:
            return None
        # page cache the cgroup would reclaim counts as free; shmem (in the cache figure) does not
        reclaimable = max(0, int(stat.get(cache_key, 0)) - int(stat.get(shmem_key, 0)))
        return max(0, limit - usage + reclaimable)
    return None


def check_space(directory: str, need: int, what: str, backing: str = "files") -> None:
    if backing == "memfd":
        free, where = memory_available()
        if need > free:
            raise CapacityError(
                f"{what} needs {need / 2**20:.1f} MiB of memory (memfd) but only {free / 2**20:.1f} MiB are "
                f"available ({where}; free memory on the node, or pick another transport)"
            )
        return
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise CapacityError(
            f"{what} needs {need / 2**20:.1f} MiB in {directory} but only {free / 2**20:.1f} MiB are free "
            f"(grow /dev/shm, e.g. docker --shm-size, or pick another transport)"
        )


# -- segments ---------------------------------------------------------------------------------


@functools.cache
def memfd_support() -> tuple[bool, str]:
    """Whether segments can be memfds here: memfd_create works and a memfd can be reopened
    through /proc/<pid>/fd (probed once per process)."""
    if not hasattr(os, "memfd_create"):
        return False, "this platform has no memfd_create"
    try:
        fd = os.memfd_create("wsync-probe", os.MFD_CLOEXEC)
    except OSError as exc:
        return False, f"memfd_create failed: {exc}"
    try:
        again = os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        os.close(again)
    except OSError as exc:
        return False, f"a memfd cannot be reopened through /proc/<pid>/fd ({exc})"
    finally:
        os.close(fd)
    return True, "memfd_create works and a memfd reopens through /proc/<pid>/fd"


def resolve_backing(choice: str, directory: str) -> tuple[str, str]:
    """('memfd' | 'files', why) for a ``shm_backing`` choice; an explicit memfd that cannot work raises."""
    ok, why = memfd_support()
    files = f"named files in {directory}, left there by a job that dies until `weightsync reap` or the next start"
    if choice == "files":
        return "files", f"as configured: {files}"
    if choice == "memfd" and not ok:
        raise ConfigError(f"shm_backing=memfd cannot work on this node: {why}; use shm_backing=files")
    if ok:
        return "memfd", f"{why}: freed by the kernel when the last process holding it exits"
    return "files", f"memfd unavailable ({why}): {files}"


def create(config: SyncConfig, size: int, what: str, *, writable: bool = True, header_bytes: int = PAGE) -> Segment:
    """A new segment of ``size`` bytes, its pages reserved, in the backing ``config`` picks."""
    backing, _ = resolve_backing(config.shm_backing, config.shm_dir)
    where = "memory" if backing == "memfd" else config.shm_dir
    check_space(config.shm_dir, size, what, backing)
    name = segment_name()
    path = None if backing == "memfd" else os.path.join(config.shm_dir, name)
    if path is None:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.fchmod(fd, 0o600)  # the /proc reopen checks the inode's mode: ours only
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        # reserve the pages now: no room fails here with ENOSPC / ENOMEM, not later with
        # SIGBUS in the middle of a copy
        os.posix_fallocate(fd, 0, size)
        if path is None:  # nobody can shrink it under a reader's mapping (SIGBUS) or grow it
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException as exc:
        os.close(fd)
        if path is not None:
            os.unlink(path)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise CapacityError(f"{where} ran out of space allocating {size} bytes for {what}") from None
        raise
    ref = f"{name}@{fd}" if path is None else name
    return Segment(fd, ref, size, owner=True, writable=writable, header_bytes=header_bytes, path=path)


def locate(ref: str, directory: str) -> str:
    """A path that opens the segment ``ref`` names: its file, or /proc/<pid>/fd/<fd> of a live
    holder (its creator first). Raises ProtocolError if it is gone or not one of ours."""
    m = SEGMENT_REF.match(ref) if isinstance(ref, str) else None
    if m is None:
        raise ProtocolError(f"refusing segment name {ref!r}: not one of ours")
    name, creator, fd = m.group(1), int(m.group(2)), m.group(3)
    if fd is None:
        return os.path.join(directory, name)
    for path in _holder_paths(name, creator, int(fd)):
        try:
            if os.readlink(path) == memfd_link(name):
                return path
        except OSError:
            continue
    raise ProtocolError(f"segment {name} is gone: its sender exited and no process holds it any more")


def _holder_paths(name: str, creator: int, fd: int) -> Iterable[str]:
    yield f"/proc/{creator}/fd/{fd}"  # cheap, and the usual case
    for pid, hfd, _ in holders([name]):  # the creator died: any process still holding it
        yield f"/proc/{pid}/fd/{hfd}"


def attach(ref: str, directory: str, size: int, *, writable: bool = False, header_bytes: int = PAGE,
           header_writable: bool = False) -> Segment:
    """Map the segment ``ref`` names (as published by its creator), read-only unless ``writable``."""
    flags = (os.O_RDWR if writable or header_writable else os.O_RDONLY) | os.O_CLOEXEC
    m = SEGMENT_REF.match(ref) if isinstance(ref, str) else None
    for _ in range(3):  # a holder may close its fd between locate() and open(): look again
        path = locate(ref, directory)
        try:
            # O_NONBLOCK: should the fd number have been reused by a FIFO meanwhile, do not hang on it
            fd = os.open(path, flags | (os.O_NONBLOCK if m.group(3) else 0))
        except FileNotFoundError:
            if m.group(3) is None:
                raise ProtocolError(f"segment {m.group(1)} is gone (its sender exited?)") from None
            continue
        if m.group(3) is None or os.readlink(f"/proc/self/fd/{fd}") == memfd_link(m.group(1)):
            return Segment(fd, ref, size, owner=False, writable=writable, header_bytes=header_bytes,
                           header_writable=header_writable)
        os.close(fd)  # the fd was closed and its number reused between the check and the open
    raise ProtocolError(f"segment {m.group(1)} is gone: its holders exited while it was attached")


class Segment:
    """One mapped segment (an open fd, kept: a memfd lives while someone holds it). The creator
    owns it (and unlinks its file); others attach read-only unless ``writable`` (the ipc
    transport's control block takes writes from receivers too). With ``header_writable`` a
    read-only attacher may still write the header pages (``control``). Made by :func:`create`
    and :func:`attach`."""

    def __init__(self, fd: int, ref: str, size: int, owner: bool, writable: bool, header_bytes: int = PAGE,
                 header_writable: bool = False, path: str | None = None):
        self.fd, self.ref, self.size, self.owner, self.writable, self.path = fd, ref, size, owner, writable, path
        try:
            if not owner and os.fstat(fd).st_size < size:
                raise ProtocolError(f"segment {self.name} is truncated: {os.fstat(fd).st_size} bytes, expected {size}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            # MAP_POPULATE maps every page up front; the slot is reused, so this is paid once
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
            # the header pages once more, writable: the same memory as the start of self.mm
            self.control_mm = (mmap.mmap(fd, header_bytes, flags=mmap.MAP_SHARED)
                               if header_writable and not writable else None)
        except BaseException:
            os.close(fd)
            if owner and path is not None:
                os.unlink(path)
            raise
        with warnings.catch_warnings():
            # receivers map read-only on purpose: an engine that wrote into a loaded view
            # would fault instead of silently corrupting the segment for other receivers
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.words = np.frombuffer(self.mm, dtype=np.uint64, count=size // 8)
        self.header = self.words[: header_bytes // 8]
        self.control = (np.frombuffer(self.control_mm, dtype=np.uint64) if self.control_mm is not None
                        else self.header if writable else None)
        self.unpin: Callable[[], None] | None = None

    def pin(self, device: torch.device) -> None:
        """Page-lock the mapping for copies to and from ``device`` (see device.pin_host); a
        host-only party copies nothing to a device."""
        if self.unpin is None and device.type != "cpu":
            self.unpin = devices.pin_host(self.bytes, device, read_only=not self.writable)

    @property
    def name(self) -> str:
        return SEGMENT_REF.match(self.ref).group(1)

    def close(self) -> None:
        if self.unpin is not None:
            self.unpin()  # before the mapping goes: the driver holds its pages
            self.unpin = None
        self.bytes = self.header = self.words = self.control = None  # drop our exports so the mappings can close
        for mm in (self.mm, self.control_mm):
            try:
                if mm is not None:
                    mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when that view does
        os.close(self.fd)
        if self.owner and self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def digest_word(digest: str) -> int:
    """The manifest digest as the 64-bit word a segment's header carries: a receiver attached
    to a segment of another session or layout sees it at once."""
    return int(digest[:16], 16)


# -- waiting on a segment's words ----------------------------------------------------------------

# A receiver waiting for a bucket's ready word (and a sender waiting for receivers to release a
# buffer) used to sleep 10 .. 250 us between looks: up to 250 us late on every bucket, and
# ~4000 wake-ups a second per waiting process on a 2-core node. Here the waiter sleeps in the
# kernel on the word itself (a Linux futex on the segment's shared mapping: the futex key is the
# page and offset, so every process mapping the segment meets on it) and the writer wakes every
# sleeper right after it stores the word.
#
# - no lost wake-up: the waiter reads the word, checks its condition, then sleeps only while
#   the word still holds what it read (the kernel compares under its own lock); a store made
#   in between makes the sleep return at once;
# - futexes are 32-bit: we sleep on the low half of a uint64 word (little-endian only). A
#   store that leaves the low half equal (it never does for ready tags and versions, which
#   change their low bits every time) would only cost one sleep of at most ``max_s``;
# - every sleep is bounded by the caller (the next abort check, the deadline), so a writer
#   that dies before its wake-up costs no more than the polling did: failures still surface
#   on time as errors that name who failed;
# - where futexes are unavailable (not Linux, an unknown architecture, a big-endian machine,
#   a syscall that fails, WEIGHTSYNC_NOTIFY=poll) ``Waiter`` falls back to the short sleeps of
#   :func:`poll_sleep`.

# polling, the fallback: the first waits are short (a device bucket lands in tens of
# microseconds), later ones stay short too, since a pause overshoots the event by up to its
# own length on every bucket
POLL_FIRST_S, POLL_GROWTH, POLL_MAX_S = 10e-6, 1.5, 250e-6

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the sleepers are other processes
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _futex() -> Callable[..., int] | None:
    """libc's syscall() bound to SYS_futex, or None where futexes cannot be used (see above).
    ctypes releases the GIL for the call: a sleeping waiter holds up no other thread."""
    if os.environ.get("WEIGHTSYNC_NOTIFY", "futex") == "poll":
        return None  # forced polling: the fallback, measurable and testable on Linux
    number = _SYS_FUTEX.get(platform.machine().lower())
    if sys.platform != "linux" or number is None or sys.byteorder != "little":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32]
    return functools.partial(call, number)


def futex_available() -> bool:
    """True if waits here sleep on futexes, False if they poll."""
    return _futex() is not None


def _address(words: np.ndarray, index: int) -> int:
    return words.ctypes.data + index * words.itemsize


def wake(words: np.ndarray, index: int) -> None:
    """Wake every process sleeping on ``words[index]``; call right after storing it. Costs one
    syscall (about a microsecond) whether or not anyone sleeps."""
    futex = _futex()
    if futex is not None:
        futex(_address(words, index), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)


def poll_sleep(pause: float) -> float:
    """One polling pause; returns the next one."""
    time.sleep(pause)
    return min(pause * POLL_GROWTH, POLL_MAX_S)


class Waiter:
    """Sleeps until ``words[index]`` changes from what :meth:`look` saw, or ``max_s`` passed.
    Use: ``seen = w.look()``, check the condition, then ``w.sleep(seen, max_s)``."""

    def __init__(self, words: np.ndarray, index: int):
        if words.dtype.itemsize != 8:
            raise TypeError(f"Waiter needs uint64 words, got {words.dtype}")
        self.words, self.index = words, index
        self.futex = _futex()
        self.pause = POLL_FIRST_S

    def look(self) -> int:
        return int(self.words[self.index]) & 0xFFFFFFFF

    def sleep(self, seen: int, max_s: float) -> None:
        if max_s <= 0:
            return
        if self.futex is None:
            self.pause = poll_sleep(min(self.pause, max_s))
            return
        sec = int(max_s)
        ts = _Timespec(sec, int((max_s - sec) * 1e9))
        rc = self.futex(_address(self.words, self.index), _FUTEX_WAIT, seen, ctypes.byref(ts), None, 0)
        if rc != 0:
            err = ctypes.get_errno()
            # EAGAIN: the word changed before we slept; ETIMEDOUT, EINTR: look again
            if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
                self.futex = None  # e.g. ENOSYS under a sandbox: poll from now on


def poll_until(done: Callable[[], bool], deadline: Deadline, what: str, waiter: Waiter | None = None,
               tick: Callable[[], None] | None = None, tick_s: float = 0.2) -> None:
    """Wait for ``done()``; every ``tick_s`` ask whether to go on: ``tick()``, by default
    ``deadline.check()`` (has the coordinator aborted the version?); DeadlineExceeded naming
    ``what`` at the deadline. With a ``waiter`` on the word ``done()`` reads, sleep until that
    word changes, never past the next tick or the deadline; without one, poll with short sleeps."""
    pause, next_tick = POLL_FIRST_S, time.monotonic() + tick_s
    while True:
        seen = waiter.look() if waiter is not None else 0  # before done(): no lost wake-up
        if done():
            return
        now = time.monotonic()
        if now >= deadline.at:
            raise deadline.expired(what)
        if now >= next_tick:
            (tick or deadline.check)()
            next_tick = now + tick_s
        if waiter is not None:
            waiter.sleep(seen, min(next_tick, deadline.at) - now)
        else:
            pause = poll_sleep(pause)
