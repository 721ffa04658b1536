"""Every repository path the code and the docs cite exists: a comment naming a module that was
merged away (``broadcast_groups.py``) sends a reader nowhere. Checked: the package, the
adapters, tests, scripts, benchmarks and examples, the docs pages and the README (the CHANGELOG
is history and keeps the names of its day). A path is one starting at a folder of the repository
(``tests/conftest.py``), one inside the package (``transports/shm/transport.py``), or a bare
file name of ours (``ring.py``)."""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "weightsync"
SCANNED = ["weightsync", "integrations", "tests", "scripts", "benchmarks", "examples", "docs"]
TOP = ("weightsync", "integrations", "tests", "scripts", "benchmarks", "examples", "docs", "results", ".ci")
# a path: folders then a file with one of these suffixes, or a folder with a trailing slash
CITED = re.compile(r"(?<![\w/.~${}-])((?:\.?[\w-]+/)+(?:[\w.-]+\.(?:py|md|sh|json|toml|yml|txt|png)\b)?|"
                   r"[\w-]+\.(?:py|sh)\b)")
# bare file names of other projects that the code cites where it follows their source
THIRD_PARTY = {"set_env.sh", "ray_trainer.py", "main_ppo.py", "rdt_manager.py", "util.py", "cuda_ipc_transport.py",
               "calls.py", "tier.sh", "t.sh", "worker.py", "pyhccl.py", "hccl_engine.py", "distributed_util.py",
               "gpu_worker.py", "qwen2.py", "linear.py", "utils.py", "weight_utils.py", "fully_async_trainer.py",
               "engine_workers.py", "a.py", "b.py", "t.py", "plain.py", "marked.py", "run.sh", "sitecustomize.py",
               "site.py", "conftest.py", "gpu-kit.sh", "reductions.py"}
# folders of other projects the code cites by their own paths (vLLM, verl, Ray, torch_npu, ...)
FOREIGN = ("vllm/", "vllm_ascend/", "verl/", "recipe/", "ray/", "python/ray/", "torch_npu/", "torch/", "layers/",
           "repo/", "../shared/", "/tmp/", "out/", "OUT/", "site/", "img/", "plugin/", "vllm_rollout/")


def _exists(token: str) -> bool:
    path = token.rstrip("/")
    if token.split("/")[0] in TOP:
        # results/<name>.json and the like in a command line are what a run writes: only dated
        # results, which the docs cite as measured, must be there (their plots go to docs/img)
        if token.startswith("results/") and (not re.search(r"\d{4}-\d{2}-\d{2}", token) or token.endswith(".png")):
            return True
        return (ROOT / path).exists()
    if "/" in token:
        return (PKG / path).exists() or (ROOT / path).exists() or any(p.endswith("/" + path) for p in _ours())
    return any(p.rsplit("/", 1)[-1] == path for p in _ours())


@functools.cache
def _ours() -> tuple[str, ...]:
    """Every file of the repository (git's list: what a clone has), as paths from its top."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return tuple(out.splitlines())


def _cited() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    files = [p for d in SCANNED for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    files += [ROOT / "README.md"]
    for f in files:
        if "conformance-cache" in str(f) or f.name == "test_paths.py":
            continue
        for m in CITED.finditer(f.read_text(errors="replace")):
            token = m.group(1)
            if token.endswith("/") and not token.startswith("results/"):
                continue  # a folder alone: only a run's results are checked (the rest are keys, names)
            if token.startswith(FOREIGN) or token in THIRD_PARTY or "://" in f.read_text()[max(0, m.start() - 8):m.start()]:
                continue
            found.setdefault(token, []).append(str(f.relative_to(ROOT)))
    return found


def test_every_cited_repository_path_exists():
    missing = {t: where[:3] for t, where in _cited().items() if not _exists(t)}
    assert missing == {}


def test_a_cited_path_that_is_gone_is_found():
    assert not _exists("weightsync/coordinator/broadcast_groups.py")
    assert not _exists("broadcast_groups.py") and _exists("status_text.py")
    assert _exists("transports/shm/transport.py") and _exists("tests/conftest.py")
