"""How our segments are named and found outside the process that made them.

Names and references: the name a creator gives a segment (its pid and 128 random bits), the
reference parties publish (the name, or ``name@fd`` for a memfd), and the /proc link a memfd
of that name shows (segment.py creates and attaches by them).

Finding: which live processes hold a memfd segment (a scan of /proc/<pid>/fd), which segment
files sit in a directory, and reaping the files whose creator died (files backing only: the
kernel frees a memfd with its last holder). Used by attach (a late receiver finds a memfd through any holder), ``weightsync reap``,
``weightsync status`` and the tests' leak checks."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable

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
