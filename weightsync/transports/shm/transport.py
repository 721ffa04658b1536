"""Internal. Shared-memory transport: the sender writes each version once into a host segment
(a memfd, or a file in /dev/shm: the segments below) and every receiver on the node reads it
from there; or, when whole versions do not fit the node's shared-memory budget, it streams each
version through a ring of K host bucket buffers instead.

Segments are slots reused across versions (allocated once, not per version). The
coordinator picks the slot so that the version any receiver serves stays intact: a receiver
that fails part-way re-reads its previous version (rollback), and one that joins late reads
the latest committed version, all without the trainer.

Segment layout: header pages of uint64 words (as many as the bucket count needs), then the
buckets, each page-aligned.
  [0] magic  [1] layout digest  [2] bucket count  [3] version being written
  [8 + 3b] version + 1 once bucket b is complete (0 while it is written)  [9 + 3b] its digest
  [10 + 3b] version + 1 once a receiver verified bucket b's digest (xxh3 under auto: host)
The sender writes the bytes of a bucket, then its digest, then its ready word, so a
receiver may read bucket b as soon as the word says so: staging and receiving overlap.
A bucket's digest is verified once per node, not per receiver: under a lock on its verified
word (fcntl, released if the holder dies), the first receiver digests it and marks it; the
others see the mark and load. One that finds a bad digest marks nothing: all check for themselves.

The registry's "shm" entry is :func:`open_shm_sender` / :func:`open_shm_receiver` here: the
mode is decided once, when the sender is built, from the plan and the budget, and receivers
follow the sender's choice as it published it:

  budget     ``shm_budget_mb``, or when 0 (auto) AUTO_FRACTION of what the node can give:
             MemAvailable (or a memory cgroup's room), and for segment files no more than the
             free space of ``shm_dir``; the models beside it need the rest
  whole      when ``shm_max_segments`` x segment size <= budget (a segment: the layout above,
             one version)
  streaming  otherwise: K = (budget - control block) // bucket buffer (the largest bucket,
             page-aligned), clamped to [2, ipc.wire.MAX_BUFFERS] and to the bucket count; a
             budget without room for 2 buffers is a CapacityError that says what to set

A streaming sender and its receivers each own one end of the ring the ipc transport moves its
versions through (ipc/ring.py: control block, per-receiver release words, the sender overwrites
a buffer only once every participating receiver released it, failed receivers are not waited
for), with K buffers kept in host shared memory even on an accelerator node, so the digest is
xxh3 as for whole versions. It gives up what ipc gives up: nothing is kept (no rollback to the
previous version, a late joiner waits for the next version, the coordinator pins no slot), and
the bytes move in ``sync()``, so the trainer's tensors are read then and must not change until
it returns.

Segments and their words (the first part of this module; the ipc transport's control block and
its host buffers are segments too):
  Internal. Host shared-memory segments, mapped by every party of a node. The shm transport keeps
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

import concurrent.futures
import ctypes
import dataclasses
import errno
import fcntl
import functools
import math
import mmap
import os
import platform
import re
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ... import device as devices
from ... import digest
from ...config import MiB, SyncConfig
from ...errors import CapacityError, ConfigError, ProtocolError
from ...manifest import BucketPlan, Packer, PackViews, RowWriter, align_up, gaps, size_text
from ...records import Message, SessionRecord, VersionRecord
from .. import Bucket, Deadline, ReceiverTransport, SenderTransport, Span, TransportContext
from ..ipc.wire import CONTROL_BYTES, MAX_BUFFERS, in_flight
from .on_device import DeviceBuffers, HostCopies

if TYPE_CHECKING:
    pass


# -- segments: names, references, holders, room --------------------------------------------------

PAGE = 4096


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
           header_writable: bool = False, populate: bool = True) -> Segment:
    """Map the segment ``ref`` names (as published by its creator), read-only unless ``writable``;
    every page up front unless not ``populate`` (a party that touches only part of it)."""
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
                           header_writable=header_writable, populate=populate)
        os.close(fd)  # the fd was closed and its number reused between the check and the open
    raise ProtocolError(f"segment {m.group(1)} is gone: its holders exited while it was attached")


class Segment:
    """One mapped segment (an open fd, kept: a memfd lives while someone holds it). The creator
    owns it (and unlinks its file); others attach read-only unless ``writable`` (the ipc
    transport's control block takes writes from receivers too). With ``header_writable`` a
    read-only attacher may still write the header pages (``control``). Made by :func:`create`
    and :func:`attach`."""

    def __init__(self, fd: int, ref: str, size: int, owner: bool, writable: bool, header_bytes: int = PAGE,
                 header_writable: bool = False, path: str | None = None, populate: bool = True):
        self.fd, self.ref, self.size, self.owner, self.writable, self.path = fd, ref, size, owner, writable, path
        try:
            if not owner and os.fstat(fd).st_size < size:
                raise ProtocolError(f"segment {self.name} is truncated: {os.fstat(fd).st_size} bytes, expected {size}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            # MAP_POPULATE maps every page up front; the slot is reused, so this is paid once
            populated = getattr(mmap, "MAP_POPULATE", 0) if populate else 0
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populated, prot=prot)
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


# -- the shm transport's records -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShmSession(SessionRecord):
    transport: ClassVar[str] = "shm"
    mode: str = "whole"  # shm's two modes: "whole" here, "stream" in ShmStreamSession

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("mode", self.mode == "whole", "'whole'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShmVersion(VersionRecord):
    transport: ClassVar[str] = "shm"
    mode: str = "whole"
    segment: str  # the slot's segment reference (Segment.ref)
    size: int  # its bytes
    checksums: list[int] = dataclasses.field(default_factory=list)  # per bucket, once staged
    packed_bytes: int = 0  # once staged

    def __post_init__(self) -> None:
        self._check("mode", self.mode == "whole", "'whole'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShmRows(Message):
    """One trainer rank's part of a sharded version: the buckets it finished (it was the last of
    their writers, so it digested and published them), their digests, and the bytes it wrote."""

    buckets: list[int]
    sums: list[int]
    written: int


# -- whole versions in segments ------------------------------------------------------------------


def hashes_on_device(ctx: TransportContext, kind: str | None) -> bool:
    """Whether this party digests its buckets on its device (on_device.py): torch digests on an
    accelerator."""
    return kind == "torch" and devices.has_streams(ctx.device)


def lock_word(fd: int, word: int) -> None:
    """Take the byte-range lock on control word ``word`` of the segment, waiting for its holder.

    POSIX record locks belong to the process, not the thread, so the kernel's deadlock check
    sees one waiter where our hash threads are several: receiver A's thread holds bucket 3 and
    its other thread waits for bucket 4, held by receiver B, whose other thread now asks for
    bucket 3: EDEADLK, though A's first thread releases bucket 3 as soon as its hash is done.
    Seen with four receivers on an H200 node. Each thread holds one word at a time, so no
    true deadlock exists: ask again until the holder is done."""
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 8, 8 * word)
            return
        except OSError as exc:
            if exc.errno != errno.EDEADLK:
                raise
            time.sleep(0.001)


MAGIC = 0x5753594E43534D31  # "WSYNCSM1"
# Threads that digest written buckets ahead of the one being loaded. xxh3 releases the GIL, so
# they run beside the load and beside each other: on a GPU node host hashing was most of shm's
# time (0.19 s of a 0.31 s version of 1.17 GiB, one H200); one core stays for the loading thread
HASH_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))
_HEAD_WORDS = 8
_PER_BUCKET = 4  # ready, digest, verified, and the ranks done writing it (a sharded version)


def _ready_word(b: int) -> int:
    return _HEAD_WORDS + _PER_BUCKET * b


def header_bytes(plan: BucketPlan) -> int:
    return align_up(8 * (_HEAD_WORDS + _PER_BUCKET * plan.bucket_count), PAGE)


def layout(plan: BucketPlan) -> tuple[int, list[int]]:
    """(segment size, byte offset of each bucket) for a plan."""
    offset = header_bytes(plan)
    bases = []
    for b in plan.buckets:
        bases.append(offset)
        offset += align_up(max(b.nbytes, 1), PAGE)
    return offset, bases


def spans(buf: torch.Tensor, bases: list[int], plan: BucketPlan) -> Callable[[int, int, int], torch.Tensor | None]:
    """Unpacker's ``span`` over a buffer laid out by :func:`layout`: a view of ``nbytes`` from
    ``offset`` in ``bucket`` on through the next buckets, or None where they are not back to back."""
    buckets = plan.buckets

    def view(bucket: int, offset: int, nbytes: int) -> torch.Tensor | None:
        start, end = bases[bucket] + offset, bases[bucket] + offset + nbytes
        # buckets sit back to back only where each one before the last is full to a page edge
        b = bucket
        while bases[b] + buckets[b].nbytes < end:
            if b + 1 >= len(bases) or bases[b] + buckets[b].nbytes != bases[b + 1]:
                return None
            b += 1
        return buf[start:end]

    return view


class Slots:
    """The segments a writer keeps on its node, one per slot, reused by every version that takes
    the slot (the coordinator picks it): a version is opened (its buckets invalidated), each bucket
    written into its page-aligned place (``view``) and published (digest word, then ready word,
    sleepers woken), so receivers read bucket b as soon as it is complete. The shm sender writes
    its versions here; a relay leader (transports/relay/) the versions it relays to its host."""

    def __init__(self, ctx: TransportContext):
        self.ctx = ctx
        reap_stale(ctx.config.shm_dir)
        self.size, self.bases = layout(ctx.plan)
        self.segments: dict[int, Segment] = {}
        self.joined: dict[str, Segment] = {}  # another rank's segments this rank writes rows into
        self.current: tuple[int, Segment] | None = None  # (version, its segment) once opened
        self.sums: list[int] = []  # the open version's digests, in bucket order
        # bytes written into segments, all versions together (tests check where they are written)
        self.written = 0

    def _segment(self, slot: int) -> Segment:
        seg = self.segments.get(slot)
        if seg is None:
            seg = create(self.ctx.config, self.size, f"a segment for {len(self.ctx.manifest)} tensors",
                         header_bytes=header_bytes(self.ctx.plan))
            self.ctx.account("shm_segments", +1)
            seg.pin(self.ctx.device)  # the slot is reused for every later version: pinned once
            head = seg.header
            head[0], head[1], head[2] = MAGIC, digest_word(self.ctx.digest), self.ctx.plan.bucket_count
            self.segments[slot] = seg
        return seg

    def open(self, version: int, slot: int) -> ShmVersion:
        """Invalidate the slot's buckets for ``version``: receivers may read each one from here
        on, as soon as its ready word is set."""
        seg = self._segment(slot)
        head = seg.header
        count = self.ctx.plan.bucket_count
        words = head[_HEAD_WORDS: _HEAD_WORDS + _PER_BUCKET * count].reshape(count, _PER_BUCKET)
        words[:, 0] = 0  # invalidate every bucket first
        words[:, 2] = 0  # and its verification
        head[3] = version
        self.current, self.sums = (version, seg), []
        return ShmVersion(segment=seg.ref, size=self.size)

    def join(self, version: int, ref: str) -> None:
        """Write into ``version`` as another trainer rank opened it, in the segment ``ref``
        (a sharded session: every rank writes its own rows)."""
        seg = self.joined.get(ref)
        if seg is None:
            # not populated: this rank touches only its rows (mapping every page of the version
            # took a rank's first version in each slot seconds instead of a quarter of one)
            seg = self.joined[ref] = attach(ref, self.ctx.config.shm_dir, self.size, writable=True,
                                            header_bytes=header_bytes(self.ctx.plan), populate=False)
            self.ctx.account("shm_mappings", +1)
        if int(seg.header[3]) != version:
            raise ProtocolError(f"segment {seg.name} holds version {int(seg.header[3])}, not {version}")
        self.current, self.sums = (version, seg), []

    def last_writer(self, b: int, writers: int) -> bool:
        """This rank is done writing bucket ``b`` of the open version: whether it was the last
        of its ``writers`` ranks (then it digests and publishes the bucket). The count carries
        its version (version << 16 | ranks done): a rank still writing an aborted version into
        a slot that a newer one took neither counts for the newer one nor completes it."""
        (version, seg), word = self.current, _ready_word(b) + 3
        lock_word(seg.fd, word)  # one rank at a time counts itself in; the kernel drops it if we die
        try:
            tag = int(seg.control[word])
            if tag >> 16 > version:
                raise ProtocolError(f"bucket {b}: version {tag >> 16} took the slot while this rank wrote "
                                    f"version {version} (given up)")
            done = (tag & 0xFFFF if tag >> 16 == version else 0) + 1
            seg.control[word] = np.uint64(version << 16 | done)
        finally:
            fcntl.lockf(seg.fd, fcntl.LOCK_UN, 8, 8 * word)
        return done == writers

    def view(self, b: int, nbytes: int) -> torch.Tensor:
        """Where bucket ``b`` of the open version goes (``nbytes``: the version's length of it)."""
        seg = self.current[1]
        return seg.bytes[self.bases[b]: self.bases[b] + nbytes]

    def publish_last(self, b: int, writers: int, value: int | None) -> None:
        """The last of bucket ``b``'s ``writers`` publishes it, under the lock its count is kept
        under, and only while the count is still this version's: a rank that finished writing an
        aborted version after a newer one took the slot and published the bucket must not
        overwrite that bucket's digest and ready words."""
        (version, seg), word = self.current, _ready_word(b) + 3
        lock_word(seg.fd, word)
        try:
            tag = int(seg.control[word])
            if tag != version << 16 | writers:
                raise ProtocolError(f"bucket {b}: version {tag >> 16} took the slot while this rank wrote "
                                    f"version {version} (given up)")
            self.publish(b, 0, value)
        finally:
            fcntl.lockf(seg.fd, fcntl.LOCK_UN, 8, 8 * word)

    def publish(self, b: int, nbytes: int, value: int | None) -> None:
        """Bucket ``b`` of the open version is written (``value``: its digest, None: off)."""
        version, seg = self.current
        head, word = seg.header, _ready_word(b)
        if value is not None:
            self.sums.append(value)
            head[word + 1] = value
        head[word] = np.uint64(version + 1)
        wake(head, word)  # receivers sleeping on the word (Waiter)
        self.written += nbytes

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
            self.ctx.account("shm_segments", -1)
        for seg in self.joined.values():
            seg.close()
            self.ctx.account("shm_mappings", -1)
        self.segments.clear()
        self.joined.clear()
        self.current = None


class ShmSender(SenderTransport):
    """Whole versions: each version packed once into a slot's segment, in stage()."""

    def __init__(self, ctx: TransportContext, why: str = "shm whole versions"):
        self.ctx = ctx
        # hashed where the tensors are (on_device.py on an accelerator node), host memory on a CPU
        kind = digest.kind_of(ctx.config, ctx.device)
        # versions stay in their segments: late or restarted receivers catch up without the
        # trainer; receivers verify a segment ahead (prefetch), nothing else is sent
        self.session = ShmSession(digest_kind=kind, keeps_versions=True, ahead=True, why=why)
        # on an accelerator node each bucket is digested on the device before its copy to the host
        self.on_device = DeviceBuffers(ctx) if hashes_on_device(ctx, kind) else None
        self.slots = Slots(ctx)
        self.views = PackViews()  # where each bucket's tensors go in each slot, made once
        self._wrote: tuple[int, Segment] | None = None  # the version whose rows this rank wrote last

    @property
    def packed_bytes(self) -> int:
        """Bytes packed into segments, all versions together: everything the trainer writes
        happens in stage(); tests check that the barrier adds nothing."""
        return self.slots.written

    def announce(self, version: int, slot: int) -> ShmVersion:
        """Open the slot for ``version``: receivers may read each bucket from here on, as soon as
        it is written."""
        return self.slots.open(version, slot)

    def stage(self, version: int, slot: int, packer: Packer) -> ShmVersion:
        slots = self.slots
        if slots.current is None or slots.current[0] != version:
            slots.open(version, slot)
        kind, plan = self.session.digest_kind, packer.plan  # the packer's wire lengths
        lengths = [bucket.nbytes for bucket in plan.buckets]
        if self.on_device is not None:
            run = HostCopies(self.on_device, plan)
            for b in range(plan.bucket_count):
                landed, buf = run.claim(b)
                for done, value in landed:
                    slots.publish(done, lengths[done], value)
                run.done(b, packer.fill(b, buf, kind, self.on_device.views), slots.view(b, lengths[b]))
            for done, value in run.landed(plan.bucket_count - 1):
                slots.publish(done, lengths[done], value)
        else:
            for b in range(plan.bucket_count):
                value = packer.fill(b, slots.view(b, lengths[b]), kind, self.views)  # hashed as it packed
                slots.publish(b, lengths[b], digest.as_int(value) if kind else None)
        seg, sums = slots.current[1], slots.sums
        slots.current = None
        return ShmVersion(segment=seg.ref, size=slots.size, checksums=sums, packed_bytes=sum(lengths),
                          digest=digest.version_digest(kind, sums) if kind else None)

    def send(self, version: int, deadline: Deadline) -> str | None:
        return None  # every byte moved in stage()

    # -- a sharded session (transports.WritesRows): every trainer rank writes its own rows ----

    def join(self, version: int, record: VersionRecord) -> None:
        if not isinstance(record, ShmVersion):
            raise ProtocolError(f"shm: version {version} was opened in streaming mode; sharded versions need whole ones")
        self.slots.join(version, record.segment)

    def write_rows(self, version: int, rows: RowWriter) -> ShmRows:
        slots, plan, kind = self.slots, self.ctx.plan, self.session.digest_kind
        if slots.current is None or slots.current[0] != version:
            raise ProtocolError(f"shm: rows of version {version} written before the version was opened or joined")
        finished, sums, written = [], [], 0
        for b in rows.buckets:
            n = plan.buckets[b].nbytes
            dst = slots.view(b, n)
            written += rows.fill(b, dst)
            if not slots.last_writer(b, rows.rows.writers[b]):
                continue
            value = None
            if kind is not None:
                for start, end in gaps(plan.buckets[b]):
                    dst[start:end].zero_()  # padding holds an older version's bytes
                value = digest.as_int(digest.compute(kind, dst))
                sums.append(value)
            finished.append(b)
            slots.publish_last(b, rows.rows.writers[b], value)
        slots.written += written
        self._wrote, slots.current = (version, slots.current[1]), None
        return ShmRows(buckets=finished, sums=sums, written=written)

    def merge(self, version: int, parts: list[Any]) -> ShmVersion:
        plan, kind = self.ctx.plan, self.session.digest_kind
        sums: dict[int, int] = {}
        for wire in parts:
            part = ShmRows.from_wire(wire)
            sums.update(zip(part.buckets, part.sums) if kind is not None else ((b, 0) for b in part.buckets))
        missing = [b for b in range(plan.bucket_count) if b not in sums]
        if missing:
            raise ProtocolError(f"version {version}: no trainer rank finished buckets {missing[:8]}")
        wrote, seg = self._wrote
        if wrote != version:
            raise ProtocolError(f"shm: version {version} merged, but this rank last wrote version {wrote}")
        ordered = [sums[b] for b in range(plan.bucket_count)]
        return ShmVersion(segment=seg.ref, size=self.slots.size, checksums=ordered if kind else [],
                          packed_bytes=plan.payload_bytes,
                          digest=digest.version_digest(kind, ordered) if kind else None)

    def close(self) -> None:
        self.views.clear()
        if self.on_device is not None:
            self.on_device.close()
        self.slots.close()


PAGE_BYTES = 4096


class ShmReceiver(ReceiverTransport):
    """A reader of whole versions from the sender's segments; verifies each bucket once per node
    (module doc) on its way in, and keeps the segments mapped for rollback and catch-up."""

    def __init__(self, ctx: TransportContext, session: ShmSession):
        self.ctx = ctx
        self.digest_kind = ctx.digest_kind  # None where this receiver's config turns digests off
        self.directory = ctx.config.shm_dir
        self.size, self.bases = layout(ctx.plan)
        self.attached: dict[str, Segment] = {}
        self._attach_lock = threading.Lock()
        # fcntl locks belong to the process, so they do not keep two threads of one receiver
        # (a user's prefetch() thread beside apply()) from hashing the same bucket twice
        self._hashing = [threading.Lock() for _ in ctx.plan.buckets]
        # (version, bucket) -> its digest check, started as soon as the bucket was written
        self._ahead: dict[tuple[int, int], concurrent.futures.Future] = {}
        self._ahead_lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._generation = 0  # bumped whenever a mapping goes (Bucket.generation)
        self.verified_ahead: int | None = None
        # torch digests on an accelerator: each bucket is copied to the device and checked there
        self.on_device = DeviceBuffers(ctx) if hashes_on_device(ctx, self.digest_kind) else None

    def _attach(self, name: str) -> Segment:
        with self._attach_lock:  # prefetch() may run in a thread beside apply()
            return self._attach_locked(name)

    def _attach_locked(self, name: str) -> Segment:
        seg = self.attached.get(name)
        if seg is None:
            seg = attach(name, self.directory, self.size, header_bytes=header_bytes(self.ctx.plan),
                         header_writable=True)
            if seg.header[0] != MAGIC or seg.header[1] != digest_word(self.ctx.digest):
                seg.close()
                raise ProtocolError(f"segment {name} holds another layout than this session's manifest")
            if len(self.attached) >= self.ctx.config.shm_max_segments:
                # the sender recycles at most shm_max_segments slots; drop the oldest mapping
                oldest = next(iter(self.attached))
                self.attached.pop(oldest).close()
                self._generation += 1
                self.ctx.account("shm_mappings", -1)
            seg.pin(self.ctx.device)
            self.attached[name] = seg
            self.ctx.account("shm_mappings", +1)
        return seg

    def receive(self, version: int, record: VersionRecord, deadline: Deadline) -> Iterator[Bucket]:
        if not isinstance(record, ShmVersion):
            raise ProtocolError(f"shm: version {version} is published in streaming mode, but this receiver attached "
                                f"to a whole-version session; restart the receiver")
        seg = self._attach(record.segment)
        size = os.fstat(seg.fd).st_size
        if size < self.size:
            # reading a mapping past the end of its file raises SIGBUS: check before touching it
            raise ProtocolError(f"segment {seg.name} was truncated to {size} bytes; version {version} needs {self.size}")
        if self.on_device is not None:
            yield from self._receive_on_device(version, record, seg, deadline)
            return
        head = seg.header
        ready = version + 1
        sums = record.checksums or None
        buckets = record.moves(self.ctx.plan).buckets
        started: list[tuple[int, int]] = []
        try:
            for b, bucket in enumerate(buckets):
                word = _ready_word(b)
                self._wait_ready(head, word, ready, version, b, deadline)
                expected = self._expected(head, word, sums, version, b)
                view = self._view(seg, b, bucket.nbytes)
                checked = ""
                if expected is not None:
                    started += self._hash_ahead(version, record, seg, buckets, b)
                    checked = "here" if self._verified(version, record, b, view, expected) else "peer"
                yield Bucket(b, view, expected, checked, self._generation)
                if int(head[word]) != ready:
                    raise ProtocolError(f"bucket {b} of version {version} was overwritten while it was loaded")
        finally:
            # a hashing thread must not read a mapping after its version was given up or closed
            with self._ahead_lock:
                pending = [f for f in (self._ahead.pop(key, None) for key in started) if f is not None]
            for f in pending:
                f.cancel()
            concurrent.futures.wait(pending)

    def _receive_on_device(self, version: int, record: ShmVersion, seg: Segment, deadline: Deadline) -> Iterator[Bucket]:
        """Each bucket, once written, copied from the segment into a device buffer of this
        receiver's device once the loads out of the bucket two before landed, and yielded from
        there: what the receiver verifies is what the engine loads (on_device.py)."""
        head, ready, sums = seg.header, version + 1, record.checksums or None
        plan = record.moves(self.ctx.plan)
        buffers = self.on_device
        for b, dst, loaded in buffers.receiving(plan):
            word = _ready_word(b)
            self._wait_ready(head, word, ready, version, b, deadline)
            expected = self._expected(head, word, sums, version, b)
            dst.copy_(self._view(seg, b, plan.buckets[b].nbytes), non_blocking=True)
            yield Bucket(b, dst, expected, "", buffers.generation)  # its check is of this copy, the receiver's
            loaded.mark(b)
        for b in range(plan.bucket_count):
            if int(head[_ready_word(b)]) != ready:
                raise ProtocolError(f"bucket {b} of version {version} was overwritten while it was loaded")

    def _expected(self, head: np.ndarray, word: int, sums: list[int] | None, version: int, b: int) -> int | None:
        """The digest the sender wrote for bucket b (None: digests off here)."""
        expected = int(head[word + 1]) if self.digest_kind else None
        if sums is not None and expected is not None and sums[b] != expected:
            raise ProtocolError(f"bucket {b} of version {version}: header checksum differs from the sender's report")
        return expected

    def _hash_ahead(self, version: int, record: ShmVersion, seg: Segment, buckets: Any, b: int) -> list[tuple[int, int]]:
        """Start the digest check of the written buckets from b on, up to HASH_THREADS + 1 of
        them, so they are verified while earlier ones load. Returns the keys it started."""
        head, ready, started = seg.header, version + 1, []
        with self._ahead_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="weightsync-shm-hash")
            for k in range(b, min(len(buckets), b + HASH_THREADS + 1)):
                word = _ready_word(k)
                if (version, k) in self._ahead or int(head[word]) != ready:
                    continue
                self._ahead[(version, k)] = self._pool.submit(self._verify_here, version, record, k,
                                                             self._view(seg, k, buckets[k].nbytes), int(head[word + 1]))
                started.append((version, k))
        return started

    def _view(self, seg: Segment, b: int, nbytes: int) -> torch.Tensor:
        return seg.bytes[self.bases[b]: self.bases[b] + nbytes]

    @staticmethod
    def _wait_ready(head: np.ndarray, word: int, ready: int, version: int, b: int, deadline: Deadline) -> None:
        if int(head[word]) == ready:
            return
        # the deadline's check raises if the coordinator aborted the version (sender died, ...)
        poll_until(lambda: int(head[word]) == ready, deadline, f"bucket {b} of version {version} was not written",
                   Waiter(head, word))

    def _verified(self, version: int, record: ShmVersion, b: int, buf: torch.Tensor, expected: int) -> bool:
        """Verify bucket b unless another receiver on the node already did (module doc); True if
        this receiver hashed it. A ChecksumError is raised here, in bucket order."""
        with self._ahead_lock:
            started = self._ahead.pop((version, b), None)
        return started.result() if started is not None else self._verify_here(version, record, b, buf, expected)

    def _verify_here(self, version: int, record: ShmVersion, b: int, buf: torch.Tensor, expected: int) -> bool:
        seg = self._attach(record.segment)
        word, mark = _ready_word(b) + 2, np.uint64(version + 1)
        if seg.control[word] == mark:
            return False
        with self._hashing[b]:
            # a byte-range lock on the word: one hasher per bucket; the kernel drops it if we die
            lock_word(seg.fd, word)
            try:
                if seg.control[word] == mark:
                    return False
                digest.verify(self.digest_kind, b, buf, expected, version)
                seg.control[word] = mark
                return True
            finally:
                fcntl.lockf(seg.fd, fcntl.LOCK_UN, 8, 8 * word)

    def open_ahead(self) -> int | None:
        # the segment holds the whole version already: ahead is verifying it (prefetch); what a
        # receiver digesting on its device checks is its own copy, made at the barrier
        if self.on_device is not None:
            return None
        return 0 if self.ctx.config.receive_ahead != "off" and self.digest_kind is not None else None

    def prefetch(self, version: int, record: VersionRecord, deadline: Deadline) -> bool:
        """Verify (and mark for the node) each bucket as soon as the sender wrote it. With
        receive_ahead, also map every page of it into this process (one byte read per page):
        the receiver that did not hash a bucket would otherwise take its page faults in the
        barrier's load."""
        if self.on_device is not None or self.digest_kind is None:
            return False  # its check is of the copy on the device, made when the version is loaded
        touch = self.ctx.config.receive_ahead != "off"
        for bucket in self.receive(version, record, deadline):
            if touch and bucket.data.numel():
                bucket.data[::PAGE_BYTES].max()
        self.verified_ahead = version
        return True

    def received_ahead(self, version: int, record: VersionRecord) -> bool:
        return self.verified_ahead == version

    def span(self, version: int, record: VersionRecord) -> Span | None:
        if not isinstance(record, ShmVersion) or self.on_device is not None:
            return None  # receive() says why; or loads come from the device buffers, bucket by bucket
        return spans(self._attach(record.segment).bytes, self.bases, self.ctx.plan)

    def can_replay(self, version: int, record: VersionRecord) -> bool:
        if not isinstance(record, ShmVersion):
            return False
        try:
            seg = self._attach(record.segment)
        except ProtocolError:
            return False
        head = seg.header
        return int(head[3]) == version and all(
            int(head[_ready_word(b)]) == version + 1 for b in range(self.ctx.plan.bucket_count)
        )

    def close(self) -> None:
        if self.on_device is not None:
            self.on_device.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # before the mappings they read go
        for seg in self.attached.values():
            seg.close()
            self.ctx.account("shm_mappings", -1)
        self.attached.clear()
        self._generation += 1


# -- the mode: whole versions or a streaming ring, from the budget ---------------------------------

AUTO_FRACTION = 0.5
MIN_BUFFERS = 2  # one being written while receivers read the other


@dataclasses.dataclass(frozen=True)
class ShmMode:
    streaming: bool
    buffers: int  # ring slots (streaming); 0 in whole-version mode
    need_bytes: int  # shared memory the mode takes at most: slots x segment, or ring + control block
    reason: str  # shown in status() as part of the transport reason


def node_capacity(config: SyncConfig) -> int:
    """Bytes the node can give to shared memory now: what the kernel can give (MemAvailable, or a
    memory cgroup's room), and for segment files no more than the free space of ``shm_dir``."""
    can = memory_available()[0]
    if resolve_backing(config.shm_backing, config.shm_dir)[0] == "files":
        st = os.statvfs(config.shm_dir)
        can = min(can, st.f_bavail * st.f_frsize)
    return can


def budget(config: SyncConfig, capacity: Callable[[SyncConfig], int] = node_capacity,
           reserve: int = 0) -> tuple[int, str]:
    """(budget in bytes, where it comes from). ``reserve``: host memory the trainer holds
    beside the segments (delta sync's snapshot), taken from what the node can give first."""
    if config.shm_budget_mb > 0:
        return int(config.shm_budget_mb * MiB), f"shm_budget_mb={config.shm_budget_mb:g}"
    can = max(0, capacity(config) - reserve)
    beside = f" beside delta sync's {size_text(reserve)} host snapshot" if reserve else ""
    return int(can * AUTO_FRACTION), f"auto: {AUTO_FRACTION:g} x {size_text(can)} the node can give{beside}"


def choose_mode(plan: BucketPlan, config: SyncConfig, capacity: Callable[[SyncConfig], int] = node_capacity,
                reserve: int = 0) -> ShmMode:
    """``reserve``: what the sender's packing keeps in host memory on this node (TransportContext.host_reserve),
    out of the same budget."""
    limit, source = budget(config, capacity, reserve)
    segment = layout(plan)[0]
    slots = config.shm_max_segments
    whole = slots * segment
    if whole <= limit:
        return ShmMode(False, 0, whole, f"shm whole versions: {slots} x {size_text(segment)} = {size_text(whole)} "
                                        f"within the budget of {size_text(limit)} ({source})")
    buffer = align_up(max([b.nbytes for b in plan.buckets] + [1]), PAGE)
    control = align_up(CONTROL_BYTES, PAGE)
    fits = max(0, limit - control) // buffer
    if fits < MIN_BUFFERS:
        least = MIN_BUFFERS * buffer + control
        raise CapacityError(
            f"shm: the budget of {size_text(limit)} ({source}) holds neither {slots} whole versions "
            f"({slots} x {size_text(segment)}) nor a ring of {MIN_BUFFERS} bucket buffers of {size_text(buffer)} "
            f"plus a {size_text(control)} control block: set shm_budget_mb >= {math.ceil(least * 100 / MiB) / 100:g}, "
            f"or a smaller "
            f"bucket_mb{', or free memory / grow ' + config.shm_dir if config.shm_budget_mb == 0 else ''}")
    k = max(1, min(fits, in_flight(MAX_BUFFERS), plan.bucket_count))  # WEIGHTSYNC_RING_BUFFERS may cap it to measure
    return ShmMode(True, k, k * buffer + control,
                   f"shm streaming: whole versions need {size_text(whole)} ({slots} x {size_text(segment)}), budget "
                   f"{size_text(limit)} ({source}); ring of {k} x {size_text(buffer)}; keeps no version (no "
                   f"rollback, late joiners wait for the next version, tensors are read during sync())")
