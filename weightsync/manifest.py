"""Internal. A version's layout: the manifest, the ordered (name, dtype, shape) list a version carries,
and the bucket plan every party derives from it (packing bytes into that plan: packing.py).

Pure functions over tensors and byte buffers: building a manifest from tensors and checking it
against what a receiver's model expects, before any byte moves; laying it out into fixed-size
buckets. The plan depends only on the manifest, the bucket size and the alignment, so sender and
every receiver compute the same plan on their own and it is reused for every version of a
session.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import xxhash

from .errors import ManifestError

# Every dtype a CPU torch can allocate and copy bit-exactly. Sub-byte "bits" types are left out:
# no model stores weights in them and torch cannot slice them by bytes.
_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
_NAME_OF = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise ManifestError(f"dtype {dtype} is not supported by weightsync") from None


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ManifestError(f"unknown dtype name {name!r}") from None


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a manifest.

    Attributes:
        name: The tensor's name as the trainer offers it.
        dtype: Its dtype's name (``"bfloat16"``, ...; torch's name without ``torch.``).
        shape: Its shape.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        return dtype_of(self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.torch_dtype.itemsize

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.numel * self.itemsize

    def describe(self) -> str:
        """Dtype and shape for messages.

        Returns:
            E.g. ``bfloat16[896, 4864]``.
        """
        return f"{self.dtype}{list(self.shape)}"


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The ordered (name, dtype, shape) list every version of a session carries; receivers
    check it against their model before any byte moves.

    Attributes:
        specs: The tensors, in the order the trainer offers them.

    Raises:
        ManifestError: Two tensors have the same name.
    """

    specs: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for spec in self.specs:
            if spec.name in seen:
                raise ManifestError(f"duplicate tensor name {spec.name!r} in manifest")
            seen.add(spec.name)

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self):
        return iter(self.specs)

    def __getitem__(self, i: int) -> TensorSpec:
        return self.specs[i]

    @property
    def total_bytes(self) -> int:
        """Bytes of every tensor's data together (the payload, without alignment)."""
        return sum(s.nbytes for s in self.specs)

    def index(self) -> dict[str, int]:
        """Where each tensor is in the manifest.

        Returns:
            Tensor name -> its position.
        """
        return {s.name: i for i, s in enumerate(self.specs)}

    def to_wire(self) -> list[list[Any]]:
        """The manifest as plain data for the control plane (msgpack).

        Returns:
            ``[[name, dtype, [dims...]], ...]`` in manifest order.
        """
        return [[s.name, s.dtype, list(s.shape)] for s in self.specs]

    @classmethod
    def from_wire(cls, wire: Iterable[Any]) -> Manifest:
        """Check and rebuild a manifest received as ``to_wire()`` gave it.

        Args:
            wire: ``[[name, dtype, [dims...]], ...]``.

        Returns:
            The manifest.

        Raises:
            ManifestError: An entry is malformed, names an unknown dtype or has an invalid
                shape, or a name repeats.
        """
        specs = []
        for item in wire:
            if not (isinstance(item, (list, tuple)) and len(item) == 3):
                raise ManifestError(f"malformed manifest entry {item!r}")
            name, dtype, shape = item
            if not isinstance(name, str) or not isinstance(dtype, str):
                raise ManifestError(f"malformed manifest entry {item!r}")
            dtype_of(dtype)
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ManifestError(f"tensor {name!r} has an invalid shape {shape!r}")
            specs.append(TensorSpec(name, dtype, tuple(shape)))
        return cls(tuple(specs))

    @functools.cached_property
    def expected(self) -> list[tuple[str, torch.dtype, torch.Size]]:
        """(name, dtype, shape) of each tensor as a tensor offered for it is compared (packing)."""
        return [(s.name, s.torch_dtype, torch.Size(s.shape)) for s in self.specs]

    def digest(self) -> str:
        """Identifies the layout: equal digests mean the same names, dtypes, shapes, order.

        Returns:
            The xxh3-128 hex digest of the layout.
        """
        h = xxhash.xxh3_128()
        for s in self.specs:
            h.update(f"{s.name}\0{s.dtype}\0{','.join(map(str, s.shape))}\n".encode())
        return h.hexdigest()


def spec_of(name: str, tensor: Any) -> TensorSpec:
    """The spec of one offered tensor, refusing inputs we cannot send as they are."""
    if isinstance(tensor, TensorSpec):
        return TensorSpec(name, tensor.dtype, tuple(tensor.shape))
    if hasattr(tensor, "full_tensor") and hasattr(tensor, "placements"):
        raise ManifestError(
            f"tensor {name!r} is a DTensor (sharded); call .full_tensor() on every rank "
            "(it is a collective) and pass the result"
        )
    if not isinstance(tensor, torch.Tensor):
        raise ManifestError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise ManifestError(f"tensor {name!r} has layout {tensor.layout}; only dense tensors can be sent")
    return TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def build_manifest(named: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Manifest:
    """Manifest of named tensors (or specs), in the order given.

    Args:
        named: A mapping name -> tensor (or TensorSpec), or an iterable of such pairs.

    Returns:
        The manifest.

    Raises:
        ManifestError: A tensor is a DTensor (call ``full_tensor()`` first), sparse, not a
            tensor, of a dtype weightsync does not move, or a name repeats.
    """
    items = named.items() if isinstance(named, Mapping) else named
    return Manifest(tuple(spec_of(name, t) for name, t in items))


Expected = Mapping[str, Any] | Callable[[Manifest], list[str]]


def check_manifest(manifest: Manifest, expected: Expected, strict: bool = True) -> None:
    """Raise ManifestError naming every tensor the receiver cannot accept.

    ``expected`` is the receiver's view of its model: a mapping name -> tensor or TensorSpec
    (names compared exactly), or a callable returning a list of problems (for engines whose
    parameter names differ from the trainer's, such as vLLM's fused projections).
    With ``strict``, a tensor the receiver expects but the manifest lacks is a problem too.
    """
    if callable(expected) and not isinstance(expected, Mapping):
        problems = list(expected(manifest))
    else:
        problems = []
        want = {name: spec_of(name, t) for name, t in expected.items()}
        for spec in manifest:
            mine = want.get(spec.name)
            if mine is None:
                problems.append(f"unknown tensor {spec.name!r} ({spec.describe()}): the receiver's model has no such name")
            elif mine.dtype != spec.dtype:
                problems.append(f"tensor {spec.name!r} has dtype {spec.dtype}, the receiver expects {mine.dtype}")
            elif mine.shape != spec.shape:
                problems.append(
                    f"tensor {spec.name!r} has shape {list(spec.shape)}, the receiver expects {list(mine.shape)}"
                )
        if strict:
            offered = {s.name for s in manifest}
            missing = [n for n in want if n not in offered]
            if missing:
                shown = ", ".join(repr(n) for n in missing[:5])
                more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
                problems.append(f"missing tensor(s) {shown}{more}: the receiver expects them but the sender offers none")
    if problems:
        shown = "; ".join(problems[:10])
        more = f" (+{len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ManifestError(f"manifest rejected: {shown}{more}")


def check_names(manifest: Manifest, named: Mapping[str, Any]) -> None:
    """Whole-version check for a mapping, so nothing is written when any name is off."""
    want = manifest.index()
    unknown = [n for n in named if n not in want]
    if unknown:
        raise ManifestError(f"unknown tensor {unknown[0]!r}: not in the session's manifest")
    missing = [s.name for s in manifest if s.name not in named]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        raise ManifestError(f"missing tensor(s) {shown}: {len(missing)} of {len(manifest)} were not given")
    for i, (name, t) in enumerate(named.items()):
        if manifest[i].name != name:
            raise ManifestError(
                f"tensor {name!r} is out of order: position {i} of the manifest is {manifest[i].name!r}"
            )
        check_spec(manifest, i, name, t)


def check_one(manifest: Manifest, i: int, name: str, tensor: Any, seen: set[str]) -> None:
    """The ``i``-th tensor of a version given as pairs, as it arrives (``seen``: names so far)."""
    if name in seen:
        raise ManifestError(f"duplicate tensor name {name!r} in one version")
    seen.add(name)
    if i >= len(manifest):
        raise ManifestError(f"unknown tensor {name!r}: not in the session's manifest ({len(manifest)} tensors)")
    if manifest[i].name != name:
        if name in manifest.index():
            raise ManifestError(
                f"tensor {name!r} is out of order: position {i} of the manifest is {manifest[i].name!r}"
            )
        raise ManifestError(f"unknown tensor {name!r}: not in the session's manifest")
    check_spec(manifest, i, name, tensor)


def check_spec(manifest: Manifest, i: int, name: str, tensor: Any) -> None:
    """Tensor ``name`` has the dtype and shape of the manifest's ``i``-th entry."""
    got, want = spec_of(name, tensor), manifest[i]
    if got.dtype != want.dtype:
        raise ManifestError(f"tensor {name!r} has dtype {got.dtype}, the manifest says {want.dtype}")
    if got.shape != want.shape:
        raise ManifestError(f"tensor {name!r} has shape {list(got.shape)}, the manifest says {list(want.shape)}")


# The bucket plan: a manifest laid out into buckets, and the packing and unpacking over it


@dataclasses.dataclass(frozen=True)
class Slice:
    """Bytes [start, start + nbytes) of tensor ``tensor`` live at ``offset`` in bucket ``bucket``."""

    tensor: int
    bucket: int
    offset: int
    start: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    index: int
    nbytes: int  # bytes used, the extent checksummed and moved
    slices: tuple[Slice, ...]


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    bucket_bytes: int
    align: int
    buckets: tuple[Bucket, ...]
    # per tensor, its slices in byte order (one unless the tensor is larger than a bucket)
    tensor_slices: tuple[tuple[Slice, ...], ...]

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for b in self.buckets for s in b.slices)

    @property
    def bucket_count(self) -> int:
        return len(self.buckets)

    def with_lengths(self, lengths: list[int]) -> BucketPlan:
        """This plan with bucket b moving ``lengths[b]`` bytes (its slices stay for reference only):
        a delta version's wire plan, its buckets encoded (delta/packing.py)."""
        if len(lengths) != self.bucket_count:
            raise ValueError(f"{len(lengths)} delta lengths for a plan of {self.bucket_count} buckets")
        for b, n in zip(self.buckets, lengths):
            if not 0 <= n <= self.bucket_bytes:
                raise ValueError(f"bucket {b.index}: delta length {n} does not fit a bucket of {self.bucket_bytes}")
        return dataclasses.replace(self, buckets=tuple(Bucket(b.index, n, b.slices) for b, n in zip(self.buckets, lengths)))


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def size_text(nbytes: float) -> str:
    """``nbytes`` for people to read, in three digits: 1.17 GiB, 16 MiB, 412 KiB, 96 B."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 999.5:  # beyond, three digits would round to 1e+03
            return f"{value:.0f} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB" if value < 999.5 else f"{value:.0f} TiB"


def plan_buckets(manifest: Manifest, bucket_bytes: int, align: int = 256) -> BucketPlan:
    """Place tensors in order; one larger than a bucket is split into element-aligned chunks."""
    if align < 16 or align & (align - 1):
        raise ValueError(f"align must be a power of two >= 16, got {align}")
    if bucket_bytes < align or bucket_bytes % align:
        raise ValueError(f"bucket_bytes ({bucket_bytes}) must be a positive multiple of align ({align})")
    buckets: list[list[Slice]] = [[]]
    per_tensor: list[tuple[Slice, ...]] = []
    cursor = 0
    for i, spec in enumerate(manifest):
        n = spec.nbytes
        cursor = align_up(cursor, align)
        if cursor + n > bucket_bytes and (n <= bucket_bytes or cursor >= bucket_bytes):
            # a tensor that fits in a bucket never straddles two; a big one fills what is left
            buckets.append([])
            cursor = 0
        mine = []
        start = 0
        while True:
            take = min(n - start, bucket_bytes - cursor)
            piece = Slice(i, len(buckets) - 1, cursor, start, take)
            buckets[-1].append(piece)
            mine.append(piece)
            start += take
            cursor += take
            if start >= n:
                break
            # bucket_bytes and align are multiples of 16, so every chunk ends on an element
            buckets.append([])
            cursor = 0
        per_tensor.append(tuple(mine))
    built = tuple(
        Bucket(b, max((s.offset + s.nbytes for s in sl), default=0), tuple(sl)) for b, sl in enumerate(buckets)
    )
    if built and not built[-1].slices:
        built = built[:-1]
    return BucketPlan(bucket_bytes, align, built, tuple(per_tensor))
