"""Download one distribution file (sdist or wheel) from the package index pip is configured
with, checked against a pinned sha256, into a cache directory; a file already there with the
right digest is kept. Prints the file's path.

Why not `pip download`: for an sdist pip prepares its metadata, which runs the package's build
backend (vLLM's pins torch==2.8.0 with CUDA: gigabytes); the conformance tier only reads the
files, it never builds or imports them.

usage: python scripts/fetch_dist.py FILENAME SHA256 DIR
"""

from __future__ import annotations

import hashlib
import os
import ssl
import sys
import urllib.request

from sdist_url import main as find_url


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(filename: str, sha256: str, into: str) -> str:
    path = os.path.join(into, filename)
    if os.path.exists(path) and sha256_of(path) == sha256:
        return path
    os.makedirs(into, exist_ok=True)
    url = find_url(filename, sha256)
    cafile = os.environ.get("PIP_CERT") or None
    part = path + ".part"
    with urllib.request.urlopen(url, timeout=300, context=ssl.create_default_context(cafile=cafile)) as reply, \
            open(part, "wb") as out:
        while chunk := reply.read(1 << 20):
            out.write(chunk)
    got = sha256_of(part)
    if got != sha256:
        os.unlink(part)
        raise SystemExit(f"{filename}: downloaded sha256 {got}, pinned {sha256}")
    os.replace(part, path)
    return path


if __name__ == "__main__":
    print(fetch(*sys.argv[1:4]))
