"""The README's examples run as written."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_and_is_bit_exact():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                         text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3
    assert all("bit-exact: True" in line for line in lines), out.stdout
    assert "latest committed version: 3" in out.stdout
