"""``WEIGHTSYNC_*`` names belong to the package: each one is a config key or a variable the package
itself reads (config.NON_CONFIG_ENV, which ``SyncConfig.from_env`` skips); any other is a
ConfigError. The scripts and the tests keep their own settings under ``WSTEST_*``; the three the
README gives users in the ``WEIGHTSYNC_`` form (scripts/lib/env.sh) the scripts rename before
any Python process starts."""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import re
import subprocess

from weightsync import SyncConfig
from weightsync.config import ENV_PREFIX, NON_CONFIG_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEYS = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(SyncConfig)}
# a read: os.environ["X"], os.environ.get("X"), os.getenv("X"), ${X...} or $X in a shell script
READ = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\()["']((?:WEIGHTSYNC|WSTEST)_[A-Z0-9_]+)|"""
                  r"""\$\{?((?:WEIGHTSYNC|WSTEST)_[A-Z0-9_]+)""")
NAME = re.compile(r"WEIGHTSYNC_[A-Z0-9_]+")
# the README's names for the scripts' settings, taken out by scripts/lib/env.sh
SCRIPT_NAMES = {"WEIGHTSYNC_TORCH", "WEIGHTSYNC_TIERS", "WEIGHTSYNC_VLLM_TIER"}
SCRIPTS = sorted([*(ROOT / "scripts").glob("*.sh"), *(ROOT / "scripts" / "tiers").glob("*.sh")])


def _package_names() -> set[str]:
    """Every ``WEIGHTSYNC_*`` string constant of the package and its adapters, config.py aside
    (its list is what is checked)."""
    names: set[str] = set()
    for folder in ("weightsync", "integrations"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "weightsync" / "config.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                    names.add(node.value)
    return names


def _read_by_scripts_and_tests() -> set[str]:
    names: set[str] = set()
    for folder in ("scripts", "tests", "benchmarks", ".ci"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh", "") and path.is_file() and "conformance-cache" not in str(path):
                for m in READ.finditer(path.read_text(errors="replace")):
                    names.add(m.group(1) or m.group(2))
    return names


def test_the_config_skips_exactly_the_variables_the_package_reads_besides_its_keys():
    read = _package_names()
    assert "WEIGHTSYNC_DEVICE_MODULES" in read  # the scan sees a constant (device/registry.py)
    assert read - KEYS == set(NON_CONFIG_ENV)


def test_the_scripts_and_tests_read_no_weightsync_name_of_their_own():
    read = _read_by_scripts_and_tests()
    assert {"WSTEST_TIERS", "WSTEST_SOAK_VERSIONS"} <= read  # the scan sees scripts/test.sh and a test
    assert sorted(n for n in read - KEYS - NON_CONFIG_ENV if n.startswith(ENV_PREFIX)) == []


def test_the_docs_name_no_other_weightsync_variable():
    typo = {"WEIGHTSYNC_BUCKETMB"}  # docs/troubleshooting.md's example of a ConfigError
    named = {n for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")] for n in NAME.findall(p.read_text())}
    assert SCRIPT_NAMES <= named
    assert sorted(named - KEYS - NON_CONFIG_ENV - SCRIPT_NAMES - typo) == []


def test_every_script_renames_the_readme_names_before_it_starts_python():
    assert [str(p.relative_to(ROOT)) for p in SCRIPTS if "scripts/lib/env.sh" not in p.read_text()] == []
    env = {**os.environ, **{n: f"value of {n}" for n in SCRIPT_NAMES}}
    out = subprocess.run(["bash", "-c", "set -euo pipefail; . scripts/lib/env.sh; env"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    got = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert SCRIPT_NAMES.isdisjoint(got)
    assert {n: got.get(n.replace(ENV_PREFIX, "WSTEST_")) for n in SCRIPT_NAMES} == \
        {n: f"value of {n}" for n in SCRIPT_NAMES}
