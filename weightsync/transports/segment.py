"""Host shared-memory segments: named files in a tmpfs (/dev/shm), mapped by every party of
a node. The shm transport keeps versions in them; the ipc transport's control block and its
host bucket buffers are segments too.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import warnings
from collections.abc import Callable

import numpy as np
import torch

from .. import device as devices
from ..errors import CapacityError, ProtocolError

PAGE = 4096
PREFIX = "wsync_"
SEGMENT_NAME = re.compile(r"^wsync_(\d+)_([0-9a-f]{32})$")  # wsync_<creator pid>_<128 random bits>


def segment_name() -> str:
    # 128 random bits: another user or job cannot guess the name; the pid lets a later
    # process reap segments whose creator died
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(16)}"


def reap_stale(directory: str = "/dev/shm") -> list[str]:
    """Unlink our segments whose creating process is gone; returns what was removed."""
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
    try:
        return sorted(n for n in os.listdir(directory) if SEGMENT_NAME.match(n))
    except FileNotFoundError:
        return []


class Segment:
    """One mapped segment. The creator owns (and unlinks) it; others attach read-only unless
    ``writable`` (the ipc transport's control block takes writes from receivers too). With
    ``header_writable`` a read-only attacher may still write the header pages (``control``)."""

    def __init__(self, path: str, size: int, create: bool, writable: bool | None = None, header_bytes: int = PAGE,
                 header_writable: bool = False):
        writable = create if writable is None else writable
        self.path, self.size, self.owner, self.writable = path, size, create, writable
        rw = writable or header_writable
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if create else (os.O_RDWR if rw else os.O_RDONLY)
        self.fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            if create:
                os.ftruncate(self.fd, size)
                # reserve the pages now: a full /dev/shm fails here with ENOSPC, not later
                # with SIGBUS in the middle of a copy
                os.posix_fallocate(self.fd, 0, size)
            elif os.fstat(self.fd).st_size < size:
                raise ProtocolError(f"segment {os.path.basename(path)} is truncated: "
                                    f"{os.fstat(self.fd).st_size} bytes, expected {size}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            # MAP_POPULATE maps every page up front; the slot is reused, so this is paid once
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
            # the header pages once more, writable: the same memory as the start of self.mm
            self.control_mm = (mmap.mmap(self.fd, header_bytes, flags=mmap.MAP_SHARED)
                               if header_writable and not writable else None)
        except BaseException:
            os.close(self.fd)
            if create:
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
        """Page-lock the mapping for copies to and from ``device`` (see device.pin_host)."""
        if self.unpin is None:
            self.unpin = devices.pin_host(self.bytes, device, read_only=not self.writable)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

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
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def check_space(directory: str, need: int, what: str) -> None:
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise CapacityError(
            f"{what} needs {need / 2**20:.1f} MiB in {directory} but only {free / 2**20:.1f} MiB are free "
            f"(grow /dev/shm, e.g. docker --shm-size, or pick another transport)"
        )
