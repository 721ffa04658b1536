"""How our shared-memory segments are named and referenced: the name a creator gives a
segment (its pid and 128 random bits), the reference parties publish (the name, or
``name@fd`` for a memfd), and the /proc link a memfd of that name shows. Shared by
segment.py (create / attach) and segment_scan.py (who holds a segment, reaping)."""

from __future__ import annotations

import os
import re
import secrets

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
