"""Internal. Benchmark layouts: a built-in name, or the layout (and optionally the weights) of a
safetensors file or folder, read from the file headers without loading any tensor."""

from __future__ import annotations

import json
import os
import struct

import torch

from weightsync.manifest import Manifest, TensorSpec

from .layouts import LAYOUTS, layout

# safetensors dtype codes -> our dtype names
_ST_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def safetensors_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path}")
        return files
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--model {path!r} is neither a built-in layout ({', '.join(sorted(LAYOUTS))}) "
                                f"nor a safetensors file or folder")
    return [path]


def _header(file: str) -> dict:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 * 2**20:
            raise ValueError(f"{file}: safetensors header of {n} bytes is implausible")
        return json.loads(f.read(n))


def safetensors_manifest(path: str, dtype: str | None = None) -> Manifest:
    """The tensors of a safetensors file or folder, in file order, then in the order their
    bytes lie in the file (how the checkpoint was written, so roughly the model's order).
    ``dtype`` replaces every floating-point dtype (a bf16 checkpoint benchmarked as fp32, say)."""
    specs = []
    for file in safetensors_files(path):
        header = _header(file)
        header.pop("__metadata__", None)
        for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            code = meta["dtype"]
            if code not in _ST_DTYPES:
                raise ValueError(f"{file}: tensor {name!r} has dtype {code}, which weightsync does not move")
            dt = _ST_DTYPES[code]
            if dtype and getattr(torch, dt).is_floating_point:
                dt = dtype
            specs.append(TensorSpec(name, dt, tuple(int(d) for d in meta["shape"])))
    return Manifest(tuple(specs))


def load_weights(path: str, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The real tensors, cast to the manifest's dtypes, in the manifest's order."""
    try:
        from safetensors.torch import load_file
    except ImportError as exc:  # the layout alone needs no package: only --real-weights does
        raise SystemExit("weightsync bench --real-weights reads the checkpoint with safetensors, which is not "
                         "installed: pip install 'weightsync[bench]'") from exc

    loaded: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        loaded.update(load_file(file))
    return {s.name: loaded.pop(s.name).to(s.torch_dtype).contiguous() for s in manifest}


def resolve(model: str, dtype: str | None) -> tuple[str, Manifest, str | None]:
    """(label, manifest, weights file/folder or None) for a ``--model`` value."""
    if model in LAYOUTS:
        return model, layout(model, dtype or "bfloat16"), None
    manifest = safetensors_manifest(model, dtype)
    return os.path.basename(os.path.normpath(model)), manifest, model
