"""Internal. ``weightsync bench``'s options and its presets (quick, the default, and full): what a run
measures unless the command line says otherwise."""

from __future__ import annotations

import argparse
from typing import Any

from weightsync.config import SyncConfig

from .delta_rows import DELTA_MODES
from .expect import KEYS, parse_expectation
from .hosts import LAYOUT as HOSTS_LAYOUT
from .hosts import add_arguments as add_hosts_arguments
from .layouts import LAYOUTS
from .ranks import add_arguments as add_ranks_arguments
from .updates import UPDATES

TRANSPORTS = ("shm", "ipc", "broadcast", "auto")
DEFAULT_LAYOUT = "qwen2.5-0.5b"
# ray-rdt: the Ray Direct Transport rows the device can run (rdt_rows.expand); or one by name
BASELINE_CHOICES = ("ray-user", "ray-numpy", "ray-rdt", "ray-rdt-gloo", "ray-rdt-cuda-ipc", "ray-rdt-nccl",
                    "bcast-per-tensor", "bcast-flat", "bcast-flat-load")

# What a bare `weightsync bench` runs, and what --full runs. quick answers "is this faster than
# what I would do?" in about 2.5 minutes on a shared 2-core VM: each transport as configured by default
# (digests on) against the object store, Ray Direct Transport and a flat broadcast plus load.
# full is the thorough matrix (digests off too, every baseline, more rounds and versions).
# An option given on the command line wins over its preset.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"transport": ["shm", "ipc", "broadcast"], "checksum": ["on"],
              "baselines": ["ray-numpy", "ray-rdt", "bcast-flat-load"], "rounds": 2, "versions": 3, "warmup": 2,
              "barrier_versions": 1, "ceiling_repeats": 3, "fixed_cost": "off"},
    "full": {"transport": ["shm", "ipc", "broadcast"], "checksum": ["on", "off"],
             "baselines": ["ray-user", "ray-numpy", "ray-rdt", "bcast-per-tensor", "bcast-flat", "bcast-flat-load"],
             "rounds": 3, "versions": 5, "warmup": 2, "barrier_versions": 2, "ceiling_repeats": 5, "fixed_cost": "on"},
}
# barrier_versions in a preset: per timed version (the quick run halves what full times)


def _preset_help(key: str) -> str:
    def shown(v: Any) -> str:
        if key == "barrier_versions":
            return f"{v} x versions"
        return " ".join(v) if isinstance(v, list) else str(v)

    return f"(quick: {shown(PRESETS['quick'][key])}; full: {shown(PRESETS['full'][key])})"


def apply_preset(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every option the command line left out from the chosen preset (quick unless --full)."""
    name = "full" if getattr(args, "full", False) else getattr(args, "preset", None) or "quick"
    args.preset = name
    if not hasattr(args, "model"):
        args.model = [HOSTS_LAYOUT if getattr(args, "hosts", None) else DEFAULT_LAYOUT]
    if not hasattr(args, "receivers"):  # a rank's rows against more than one reader of the segment
        # (between hosts: per receiving host)
        ranks = getattr(args, "trainer_ranks", None)
        args.receivers = [2 if ranks and not getattr(args, "hosts", None) else 1]
    for key, value in PRESETS[name].items():
        if not hasattr(args, key):
            setattr(args, key, list(value) if isinstance(value, list) else value)
            if key == "barrier_versions":
                args.barrier_versions = value * args.versions
    return args


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    # options a preset sets have no argparse default (SUPPRESS): apply_preset fills what is left out
    preset = argparse.SUPPRESS
    p.add_argument("--preset", choices=tuple(PRESETS), default="quick",
                   help="quick: shm, ipc and broadcast with digests on against ray-numpy, ray-rdt and "
                        "bcast-flat-load, 2 rounds x 3 versions (about 2.5 minutes for the 0.5B layout on a shared "
                        "2-core VM); full: every baseline, digests on and off, 3 rounds x 5 versions")
    p.add_argument("--full", action="store_true", help="the same as --preset full: the thorough matrix")
    p.add_argument("--model", "--layout", nargs="+", default=argparse.SUPPRESS, metavar="MODEL",
                   help=f"built-in layout ({', '.join(LAYOUTS)}) or a safetensors file/folder; several "
                        "(the two spellings are one option) run every row per size and print a growth table "
                        f"(default: {DEFAULT_LAYOUT}; with --hosts: {HOSTS_LAYOUT})")
    p.add_argument("--real-weights", action="store_true",
                   help="with --model PATH: send the file's tensors instead of random bits")
    p.add_argument("--dtype", default=None, help="dtype of a built-in layout (default bfloat16), or the "
                   "floating-point dtype a safetensors layout is cast to")
    p.add_argument("--transport", nargs="+", default=preset, choices=TRANSPORTS,
                   metavar="T", help=f"one or several of {', '.join(TRANSPORTS)} {_preset_help('transport')}")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl", "hccl"),
                   help="collective backend of broadcast (and the collective baselines)")
    p.add_argument("--receivers", nargs="+", type=int, default=argparse.SUPPRESS, metavar="N",
                   help="receiver counts to run (default: 1; with --trainer-ranks: 2; with --hosts and "
                        "--trainer-ranks: receivers per receiving host, 1)")
    p.add_argument("--bucket-mb", nargs="+", type=float, default=[SyncConfig().bucket_mb], metavar="MB",
                   help="bucket sizes to sweep")
    p.add_argument("--checksum", nargs="+", default=preset, choices=("on", "off"),
                   help="per-bucket digest on or off (the config's checksum), on every transport, device "
                        f"links included; both show what it costs, interleaved in one run {_preset_help('checksum')}")
    p.add_argument("--digest", default="auto", choices=("auto", "xxh3", "torch"),
                   help="digest kind when on: auto = xxh3 for host buckets, torch ops on device buckets")
    p.add_argument("--update", default="random", choices=UPDATES,
                   help="how each version differs from the one before: random = every byte (what a full sync "
                        "moves anyway); adamw-LR = one torch.optim.AdamW step at that lr on an fp32 master, sent "
                        "as bf16 (a few percent of elements change; docs/delta.md). The fraction changed is in "
                        "the JSON")
    p.add_argument("--delta", nargs="+", default=["off"], choices=DELTA_MODES,
                   help="the config's delta mode of the transport rows; several run side by side in the same "
                        "rounds, delta rows named e.g. 'broadcast (delta on)' and compared to the full row")
    p.add_argument("--versions", type=int, default=preset,
                   help=f"timed versions per row and round {_preset_help('versions')}")
    p.add_argument("--barrier-versions", type=int, default=preset,
                   help="pre-staged barriers timed per transport row and round, every other one after the "
                        f"receivers' prefetch() (what the rollout waits for in one-step-off) {_preset_help('barrier_versions')}")
    p.add_argument("--rounds", type=int, default=preset, help="rounds over every row, the order rotated each round, "
                   f"so a neighbour's load drifting during the run lands on every row alike {_preset_help('rounds')}")
    p.add_argument("--fixed-cost", nargs="?", const="on", default=preset, choices=("off", "on", "only"),
                   help="fixed-cost rows: per transport and receiver count, the layout with every tensor cut to "
                        "<= 1024 elements (qwen2.5-0.5b-fixed for the default model), digests on, the default "
                        "bucket size; they time the pre-staged barrier and split it into the receiver's phases "
                        "and the coordinator calls per version: what a version costs beyond its bytes. on (the "
                        "option alone): beside the other rows; only: these rows alone (no baselines, no copy "
                        f"ceiling) {_preset_help('fixed_cost')}")
    p.add_argument("--fixed-cost-receivers", nargs="+", type=int, default=None, metavar="N",
                   help="receiver counts of the fixed-cost rows (default: those of --receivers)")
    p.add_argument("--fixed-cost-versions", type=int, default=None, metavar="N",
                   help="pre-staged barriers timed per fixed-cost row and round (default: enough for 30 over "
                        "the rounds)")
    p.add_argument("--against", metavar="GIT_REV", default=None,
                   help="A/B: also run the transports of this git rev of the repo (extracted with git archive, "
                        "imported by its own actors), interleaved with this checkout's in the same rounds")
    p.add_argument("--warmup", type=int, default=preset, help="untimed versions first: they allocate the transport's "
                   f"reusable buffers (shm alternates two segments) and fault their pages in {_preset_help('warmup')}")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "npu"),
                   help="where trainer tensors and engine weights live")
    p.add_argument("--baselines", nargs="*", default=preset, choices=BASELINE_CHOICES, metavar="B",
                   help=f"baselines to run, any of {', '.join(BASELINE_CHOICES)} (the option with no value: none); ray-rdt is "
                        "Ray Direct Transport over GLOO on cpu, over CUDA_IPC and NCCL on cuda "
                        f"{_preset_help('baselines')}")
    p.add_argument("--ceiling-repeats", type=int, default=preset,
                   help=f"repeats of each copy for the ceiling {_preset_help('ceiling_repeats')}")
    p.add_argument("--object-store-gb", type=float, default=None,
                   help="Ray object store size (default: enough for the baselines, 3.5x the largest payload, "
                        "but at most half of the free space of /dev/shm, where Ray keeps the store)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")
    p.add_argument("--no-verify", action="store_true", help="skip the bit-exact check after each row")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. 'machine shared')")
    p.add_argument("--expect", action="append", default=[], type=_expectation, metavar="KEY>=VALUE",
                   help="assert your own goal on the fastest matching row, e.g. x_ceiling>=0.25, "
                   "shm:x_ray-numpy>=1, growth_x@4<=2.5 ([TRANSPORT:]KEY[@RECEIVERS], >= or <=); repeatable; "
                   f"exit status 1 on a miss. Keys: {', '.join(KEYS)}")
    p.add_argument("--deadline-s", type=float, default=None, metavar="S",
                   help="start no row after S seconds: the rows still to run are recorded as not run, and the "
                        "tables and --json are written from what was measured (for a job with a hard time limit; "
                        "a row that started runs to its end)")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON (schema: docs/benchmarks.md)")
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG of GB/s per transport and bucket size; with "
                   "several sizes, time per version and per GB against size")
    add_hosts_arguments(p)
    add_ranks_arguments(p)


def _expectation(text: str):
    try:
        return parse_expectation(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
