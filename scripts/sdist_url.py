"""Print the download URL of one source distribution, found on the package index pip is
configured with (PIP_INDEX_URL, pip's global.index-url, else pip's default), checked against
the sha256 the caller pins. Used where `pip install NAME==VERSION` cannot be (vLLM's empty build
reports a local version, +empty, that pip refuses for an exact pin).

usage: python scripts/sdist_url.py FILENAME SHA256
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.request


def index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        got = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                             capture_output=True, text=True)
        url = got.stdout.strip() if got.returncode == 0 else ""
    if not url:
        from pip._internal.models.index import PyPI

        url = PyPI.simple_url
    return url.rstrip("/")


def main(filename: str, sha256: str) -> str:
    project = filename.split("-")[0].lower()
    cafile = os.environ.get("PIP_CERT") or None
    request = urllib.request.Request(f"{index_url()}/{project}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60, context=ssl.create_default_context(cafile=cafile)) as reply:
        files = json.load(reply)["files"]
    for f in files:
        if f["filename"] == filename:
            if f.get("hashes", {}).get("sha256") != sha256:
                raise SystemExit(f"{filename} on the index has sha256 {f.get('hashes')}, not the pinned {sha256}")
            return f["url"]
    raise SystemExit(f"{filename} is not on the index {index_url()}")


if __name__ == "__main__":
    print(main(*sys.argv[1:3]))
