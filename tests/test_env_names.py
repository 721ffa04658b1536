"""Every ``WEIGHTSYNC_*`` variable the scripts and tests read is either a config key or listed as
not one: otherwise exporting it in a shell (``WEIGHTSYNC_TIERS=gen bash scripts/test.sh``) makes
every ``SyncConfig.load()`` in that shell's processes raise ConfigError."""

from __future__ import annotations

import dataclasses
import pathlib
import re

from weightsync import SyncConfig
from weightsync.config import ENV_PREFIX, NON_CONFIG_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]
# a read: os.environ["X"], os.environ.get("X"), os.getenv("X"), ${X...} or $X in a shell script
READ = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\()["'](WEIGHTSYNC_[A-Z0-9_]+)|\$\{?(WEIGHTSYNC_[A-Z0-9_]+)""")


def _read_names() -> set[str]:
    names: set[str] = set()
    for folder in ("scripts", "tests", "weightsync", "integrations", ".ci"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh", "") and path.is_file() and "conformance-cache" not in str(path):
                for m in READ.finditer(path.read_text(errors="replace")):
                    names.add(m.group(1) or m.group(2))
    return names


def test_every_weightsync_variable_read_outside_the_config_is_skipped_by_it():
    keys = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(SyncConfig)}
    read = _read_names()
    assert "WEIGHTSYNC_TIERS" in read  # the scan sees scripts/test.sh
    assert sorted(read - keys - NON_CONFIG_ENV) == []


def test_an_exported_tier_variable_leaves_config_loading_alone():
    assert SyncConfig.load(environ={"WEIGHTSYNC_TIERS": "gen", "WEIGHTSYNC_BUCKET_MB": "8"}).bucket_mb == 8
