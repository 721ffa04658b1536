"""The benchmark's own packages come with the `bench` extra (psutil, tqdm, safetensors): the
other commands work without them, and a command or option that needs a missing one says what
to install. (psutil itself is always importable next to Ray, which puts its vendored copy on
the path: ray/thirdparty_files.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from weightsync_bench import layout_source
from weightsync_bench.layouts import layout

from weightsync import cli

pytestmark = pytest.mark.bench  # the bench tier runs them (scripts/tiers/bench.sh)

# the command line with tqdm and safetensors unimportable (a None entry in sys.modules makes
# `import tqdm` raise ImportError, as on a machine without them)
HIDDEN = """
import sys
for name in ("tqdm", "safetensors", "safetensors.torch"):
    sys.modules[name] = None
from weightsync.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_command_whose_extra_is_missing_says_what_to_install(monkeypatch, capsys):
    # the benchmark program itself missing (a None entry in sys.modules: its import raises ImportError)
    monkeypatch.setitem(sys.modules, "weightsync_bench", None)
    assert cli.main(["bench", "--model", "tiny"]) == 2
    assert capsys.readouterr().err.strip() == ("weightsync bench needs the 'bench' extra (weightsync_bench "
                                               "is not installed): pip install 'weightsync[bench]'")


def test_doctor_runs_without_the_bench_extra():
    done = subprocess.run([sys.executable, "-c", HIDDEN, "doctor"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "platform:" in done.stdout, done.stderr[-2000:]


def test_real_weights_without_safetensors_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(SystemExit, match=r"not installed: pip install 'weightsync\[bench\]'"):
        layout_source.load_weights(str(tmp_path), layout("tiny", "bfloat16"))
