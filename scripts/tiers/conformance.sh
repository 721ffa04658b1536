#!/usr/bin/env bash
# Tier "conformance": every use our code makes of torch_npu, torch.npu, vllm_ascend and vLLM's
# distributed utilities, checked with `ast` against those packages' real source at the
# versions users run (tests/conformance). No NPU, no import of them: their files are
# downloaded from the package index, pinned by sha256, and only their .py files unpacked
# into .conformance-cache/src/<package>-<version>/. Needs no venv of its own (the packages are
# read, not installed): it runs in the main .venv. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/lib/env.sh
[ -x .venv/bin/python ] || bash scripts/setup.sh dev >&2
cache=.conformance-cache
# file  sha256  unpacked as <package>-<version>
dists=(
    "torch_npu-2.7.1-cp311-cp311-manylinux_2_28_x86_64.whl f785e2e2c75d4e4dc80c33e6f389d333deed021c7a015b91aa839df4fcec75de torch_npu-2.7.1"
    "vllm_ascend-0.10.0rc1.tar.gz b3cef184a3d3c67b151d2679b9906310122ff8510d2821117de48a76d939a9b7 vllm_ascend-0.10.0rc1"
    "vllm_ascend-0.11.0rc1.tar.gz c34b592c82bf244c05cf96cbca527dc178da4332c6c912af7b7e681a0456da70 vllm_ascend-0.11.0rc1"
    "vllm-0.10.1.tar.gz 99d00498f25b94767bb2696e88feb67730677dae605c9b8af99492dc3c34492d vllm-0.10.1"
    "vllm-0.11.0.tar.gz f435a64c24e9c4178d657a76f8edd8548ddc444012f7d06a9f79ac3a6392bfae vllm-0.11.0"
    # the weight-transfer API generation: vllm-ascend 0.23 (pins torch-npu 2.10.0.post4, runs on
    # vLLM 0.23.0), and the newest vLLM the vllm-engine tier runs (0.32.0)
    "torch_npu-2.10.0.post4-cp311-cp311-manylinux_2_28_x86_64.whl 7d88428d9bb8473919a38947617fcc481cb6e28927a8aa30e486a9bc42f30d90 torch_npu-2.10.0.post4"
    "vllm_ascend-0.23.0.post1.tar.gz a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1 vllm_ascend-0.23.0.post1"
    "vllm-0.23.0.tar.gz 760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5 vllm-0.23.0"
    "vllm-0.32.0.tar.gz d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad vllm-0.32.0"
)
# one fetch at a time (scripts/test.sh prepares tiers in the background while others run)
mkdir -p "$cache"
exec 9> "$cache/.lock"
flock 9
for entry in "${dists[@]}"; do
    read -r file sha dir <<< "$entry"
    package=${dir%%-*}
    [ "$(cat "$cache/src/$dir/.sha256" 2>/dev/null)" = "$sha" ] && continue
    path=$(.venv/bin/python scripts/fetch_dist.py "$file" "$sha" "$cache/dl")
    rm -rf "$cache/src/$dir" && mkdir -p "$cache/src/$dir"
    .venv/bin/python - "$path" "$cache/src/$dir" "$package" <<'PY'
import sys, tarfile, zipfile
from pathlib import Path

path, dest, package = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
def keep(name: str) -> str | None:
    """The path under dest of a package .py file or extension module, or None (the rest stays packed)."""
    parts = name.split("/")
    if path.endswith(".tar.gz"):
        parts = parts[1:]  # the sdist's top folder, <name>-<version>/
    if len(parts) > 1 and parts[0] == package and parts[-1].endswith((".py", ".so")) and ".." not in parts:
        return "/".join(parts)
    return None
def put(rel: str, read) -> None:
    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
    # an extension module only as an empty marker: what is compiled is known by name, never read
    (dest / rel).write_bytes(b"" if rel.endswith(".so") else read())
if path.endswith(".whl"):
    with zipfile.ZipFile(path) as z:
        for n in z.namelist():
            if (rel := keep(n)):
                put(rel, lambda: z.read(n))
else:
    with tarfile.open(path) as t:
        for m in t.getmembers():
            if m.isfile() and (rel := keep(m.name)):
                put(rel, lambda: t.extractfile(m).read())
PY
    echo "$sha" > "$cache/src/$dir/.sha256"
done
# --confcutdir: the suite's conftest (Ray, segment bookkeeping) has nothing to do with reading files
exec 9>&-
[ "${1:-}" = "--prepare" ] && exit 0
WSTEST_CONFORMANCE_DIR="$PWD/$cache/src" .venv/bin/python -m pytest --confcutdir=tests/conformance tests/conformance -rs "$@"
