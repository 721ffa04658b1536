"""Internal. The ``weightsync`` command. Each subcommand lives in its own module; ``bench`` is the
benchmark program ``weightsync_bench`` (benchmarks/), which ships beside the package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from types import ModuleType


def _bench() -> ModuleType:
    from weightsync_bench import cli

    return cli


def _doctor() -> ModuleType:
    from . import doctor

    return doctor


def _status() -> ModuleType:
    from . import status

    return status


# subcommand -> (loader of its module, which has add_<name>_arguments(parser) and run_<name>(args) -> int,
# one-line help)
SUBCOMMANDS: dict[str, tuple[Callable[[], ModuleType], str]] = {
    "bench": (_bench, "measure sync throughput of transports against baselines and the copy ceiling"),
    "doctor": (_doctor, "print platform, versions and which transports can run here"),
    "status": (_status, "print the status of a running coordinator"),
    "reap": (_status, "remove segment files (shm_backing=files) left by dead processes"),
}
# subcommands whose packages come with an extra (pyproject.toml)
EXTRAS = {"bench": "bench"}


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; tests parse the documentation's commands with it."""
    parser = argparse.ArgumentParser(
        prog="weightsync",
        description="Move model weights from an RL trainer to its rollout engines; these commands measure, "
                    "diagnose and inspect it (docs: docs/index.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (load, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_load=load)
        try:
            mod = load()
        except ImportError as exc:
            if name not in EXTRAS:
                raise
            # the other commands must work without the benchmark's packages: this one says what to install
            p.set_defaults(_missing=f"weightsync {name} needs the '{EXTRAS[name]}' extra ({exc.name or exc} is not "
                                    f"installed): pip install 'weightsync[{EXTRAS[name]}]'")
            continue
        getattr(mod, f"add_{name}_arguments", getattr(mod, "add_arguments", lambda _p: None))(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "_missing", None):  # its options are unknown here: the module that knows them is missing
        print(args._missing, file=sys.stderr)
        return 2
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    mod = args._load()
    run = getattr(mod, f"run_{args.command}", None) or mod.run
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
