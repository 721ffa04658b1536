"""Internal. A version's bytes: the manifest (the ordered (name, dtype, shape) list a version carries),
the bucket plan every party derives from it, and the copies in and out of that plan.

Building a manifest from tensors and checking it against what a receiver's model expects
happens before any byte moves. The plan depends only on the manifest, the bucket size and the
alignment, so the sender and every receiver compute the same plan on their own and reuse it
for every version of a session. A :class:`Packer` copies one version's tensors into bucket
buffers when a transport asks for a bucket (digesting it as it goes); an :class:`Unpacker`
turns a received bucket back into the (name, tensor) pairs an engine loads, as views.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import xxhash

from . import device as devices
from . import digest as digests
from .errors import ManifestError

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

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
    # a sharded session: per tensor, the row bounds of each sending rank (rank r owns rows
    # rows[i][r] up to rows[i][r + 1] of tensor i; a 0-dim tensor is one row). None: rank 0 sends all
    rows: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for spec in self.specs:
            if spec.name in seen:
                raise ManifestError(f"duplicate tensor name {spec.name!r} in manifest")
            seen.add(spec.name)
        if self.rows is not None:
            check_rows(self.specs, self.rows)

    @property
    def senders(self) -> int:
        """Trainer ranks that write each version (1 unless sharded)."""
        return len(self.rows[0]) - 1 if self.rows else 1

    def whole(self) -> Manifest:
        """This layout with rank 0 sending every tensor whole.

        Returns:
            The manifest without row bounds.
        """
        return Manifest(self.specs)

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
            ``[[name, dtype, [dims...]], ...]`` in manifest order; a sharded manifest adds each
            tensor's row bounds per sending rank as a fourth item.
        """
        if self.rows is not None:
            return [[s.name, s.dtype, list(s.shape), list(r)] for s, r in zip(self.specs, self.rows)]
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
        specs, rows = [], []
        for item in wire:
            if not (isinstance(item, (list, tuple)) and len(item) in (3, 4)):
                raise ManifestError(f"malformed manifest entry {item!r}")
            name, dtype, shape = item[:3]
            if len(item) == 4:
                if not (isinstance(item[3], (list, tuple)) and all(isinstance(r, int) for r in item[3])):
                    raise ManifestError(f"tensor {name!r} has malformed row bounds {item[3]!r}")
                rows.append(tuple(item[3]))
            if not isinstance(name, str) or not isinstance(dtype, str):
                raise ManifestError(f"malformed manifest entry {item!r}")
            dtype_of(dtype)
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ManifestError(f"tensor {name!r} has an invalid shape {shape!r}")
            specs.append(TensorSpec(name, dtype, tuple(shape)))
        if rows and len(rows) != len(specs):
            raise ManifestError("row bounds are given for some tensors of the manifest only")
        return cls(tuple(specs), tuple(rows) if rows else None)

    @functools.cached_property
    def expected(self) -> list[tuple[str, torch.dtype, torch.Size]]:
        """(name, dtype, shape) of each tensor as a tensor offered for it is compared (packing)."""
        return [(s.name, s.torch_dtype, torch.Size(s.shape)) for s in self.specs]

    def digest(self) -> str:
        """Identifies the layout: equal digests mean the same names, dtypes, shapes, order
        (whichever ranks write them: receivers see the same tensors either way).

        Returns:
            The xxh3-128 hex digest of the layout.
        """
        h = xxhash.xxh3_128()
        for s in self.specs:
            h.update(f"{s.name}\0{s.dtype}\0{','.join(map(str, s.shape))}\n".encode())
        return h.hexdigest()


def spec_of(name: str, tensor: Any) -> TensorSpec:
    """The spec of one offered tensor (a DTensor's is its full tensor's), refusing inputs we
    cannot send as they are."""
    if isinstance(tensor, TensorSpec):
        return TensorSpec(name, tensor.dtype, tuple(tensor.shape))
    if is_dtensor(tensor):
        return TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))
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


# -- sharded sessions: which trainer rank owns which rows ------------------------------------------


def is_dtensor(tensor: Any) -> bool:
    # a DTensor exists only once its module was imported: importing it here would cost every
    # sender without one ~40 MiB of modules (measured: the bench's fixed-cost rows)
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def row_count(spec: TensorSpec) -> int:
    """Rows of a tensor as ranks own them: its first dimension (a 0-dim tensor is one row)."""
    return spec.shape[0] if spec.shape else 1


def row_bytes(spec: TensorSpec) -> int:
    rows = row_count(spec)
    return spec.nbytes // rows if rows else 0


def chunk_bounds(rows: int, ranks: int) -> tuple[int, ...]:
    """Row bounds of ``rows`` split over ``ranks`` as ``Shard(0)`` splits them (torch.chunk: pieces
    of ceil(rows / ranks), the last ones shorter or empty)."""
    size = -(-rows // ranks) if rows else 0
    return tuple(min(r * size, rows) for r in range(ranks)) + (rows,)


def check_rows(specs: Sequence[TensorSpec], rows: Sequence[Sequence[int]]) -> None:
    if len(rows) != len(specs):
        raise ManifestError(f"row bounds for {len(rows)} tensors, but the manifest has {len(specs)}")
    ranks = {len(r) for r in rows}
    if len(ranks) != 1 or ranks.pop() < 2:
        raise ManifestError("row bounds must name the same number (at least one) of sending ranks for every tensor")
    for spec, bounds in zip(specs, rows):
        if bounds[0] != 0 or bounds[-1] != row_count(spec) or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ManifestError(f"tensor {spec.name!r}: row bounds {list(bounds)} do not split its "
                                f"{row_count(spec)} rows in order")


@dataclasses.dataclass(frozen=True)
class Shards:
    """How this trainer rank's tensors split the version: its index among the sending ranks,
    how many there are, and each tensor's row bounds."""

    rank: int
    ranks: int
    rows: tuple[tuple[int, ...], ...]


def shards_of(named: Sequence[tuple[str, Any]]) -> Shards | None:
    """The split of a version whose tensors are FSDP2 shards: each a DTensor on one 1-D mesh
    sharded by rows (``Shard(0)``) or replicated, or a plain tensor every rank holds (rank 0
    sends those). None where the version is not such a split (no DTensor, another mesh shape or
    placement: such a version is gathered, ``gathered``)."""
    if not any(is_dtensor(t) for _, t in named):
        return None
    from torch.distributed.tensor import Replicate, Shard

    mesh, rows = None, []
    for name, t in named:
        spec = spec_of(name, t)
        n = row_count(spec)
        if not is_dtensor(t):
            rows.append(None)
            continue
        if t.device_mesh.ndim != 1 or (mesh is not None and t.device_mesh != mesh):
            return None
        mesh = t.device_mesh
        (place,) = t.placements
        if isinstance(place, Shard) and place.dim == 0 and spec.shape:
            bounds = chunk_bounds(n, mesh.size())
            local = t.to_local()
            me = mesh.get_local_rank()
            if local.shape[0] != bounds[me + 1] - bounds[me]:
                return None  # not torch.chunk's split (a padded shard): gather it instead
            rows.append(bounds)
        elif isinstance(place, Replicate):
            rows.append((0,) + (n,) * mesh.size())
        else:
            return None
    if mesh is None or mesh.size() < 2:
        return None
    ranks = mesh.size()
    full = [r if r is not None else (0,) + (row_count(spec_of(name, t)),) * ranks for r, (name, t) in zip(rows, named)]
    return Shards(mesh.get_local_rank(), ranks, tuple(full))


def gathered(named: NamedTensors) -> Iterable[tuple[str, Any]]:
    """The tensors whole: each DTensor gathered with ``full_tensor()`` as it is reached (a
    collective every trainer rank runs, in the same order)."""
    for name, t in (named.items() if isinstance(named, Mapping) else named):
        yield name, (t.full_tensor() if is_dtensor(t) else t)


@dataclasses.dataclass(frozen=True)
class RowPiece:
    """Bytes [src, src + nbytes) of this rank's part of tensor ``tensor`` go to ``offset`` in a bucket."""

    tensor: int
    offset: int
    src: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Where one sending rank's rows go in a sharded session's buckets, from the plan alone:
    its pieces of each bucket, and how many ranks write each bucket (the last of them digests
    it; rank 0 also finishes buckets no rank writes into)."""

    rank: int
    pieces: dict[int, tuple[RowPiece, ...]]  # bucket -> this rank's pieces, for the buckets it writes
    writers: tuple[int, ...]  # per bucket

    def piece_bytes(self, b: int) -> int:
        """The bytes of this rank's rows in bucket ``b`` (0 where it has none): its piece on the
        wire where the rows travel packed (transports/relay/)."""
        return sum(p.nbytes for p in self.pieces.get(b, ()))


def plan_rows(plan: BucketPlan, manifest: Manifest, rank: int) -> RowPlan:
    if manifest.rows is None:
        raise ValueError("plan_rows needs a sharded manifest")
    pieces: dict[int, list[RowPiece]] = {}
    writers = []
    for bucket in plan.buckets:
        who = set()
        for s in bucket.slices:
            spec, bounds = manifest[s.tensor], manifest.rows[s.tensor]
            width = row_bytes(spec)
            for r in range(len(bounds) - 1):
                lo, hi = bounds[r] * width, bounds[r + 1] * width
                a, b = max(lo, s.start), min(hi, s.start + s.nbytes)
                if a >= b:
                    continue
                who.add(r)
                if r == rank:
                    pieces.setdefault(bucket.index, []).append(RowPiece(s.tensor, s.offset + a - s.start, a - lo, b - a))
        if not who:
            who.add(0)
            if rank == 0:
                pieces.setdefault(bucket.index, [])
        writers.append(len(who))
    return RowPlan(rank, {b: tuple(p) for b, p in pieces.items()}, tuple(writers))


def _rows_fit(spec: TensorSpec, name: str, t: Any, local: Any) -> bool:
    """A DTensor stands for its full tensor; a plain tensor is the full one or rows of it (its
    count is checked against this rank's bounds by the caller)."""
    if name != spec.name or not isinstance(local, torch.Tensor) or _NAME_OF.get(local.dtype) != spec.dtype:
        return False
    if is_dtensor(t):
        return tuple(t.shape) == spec.shape
    return tuple(local.shape) == spec.shape or (bool(spec.shape) and tuple(local.shape[1:]) == spec.shape[1:])


class RowWriter:
    """One version's rows of this trainer rank, copied into their places in the buckets it
    writes (``fill``); each tensor is checked against the manifest and its row bounds."""

    def __init__(self, rows: RowPlan, manifest: Manifest, named: NamedTensors):
        self.rows = rows
        items = list(named.items() if isinstance(named, Mapping) else named)
        if len(items) != len(manifest):
            check_names(manifest, dict(items))
            raise ManifestError(f"{len(items)} tensors given, the manifest has {len(manifest)}")
        self.local: list[torch.Tensor] = []
        for i, (name, t) in enumerate(items):
            spec, bounds = manifest[i], manifest.rows[i]
            local = t.to_local() if is_dtensor(t) else t
            if not _rows_fit(spec, name, t, local):
                check_one(manifest, i, name, t, {s.name for s in manifest.specs[:i]})
            lo, hi = bounds[rows.rank] * row_bytes(spec), bounds[rows.rank + 1] * row_bytes(spec)
            held = local.numel() * local.element_size()
            if held != spec.nbytes and held != hi - lo:
                raise ManifestError(f"tensor {name!r}: this rank holds {held} bytes of it; its rows "
                                    f"{bounds[rows.rank]}..{bounds[rows.rank + 1]} are {hi - lo} (the whole: {spec.nbytes})")
            flat = local.reshape(-1).view(torch.uint8) if held else torch.empty(0, dtype=torch.uint8)
            # a whole tensor (replicated, or plain) holds the other ranks' rows too: ours start at lo
            self.local.append(flat[lo:] if held == spec.nbytes and held != hi - lo else flat)

    @property
    def buckets(self) -> list[int]:
        """The buckets this rank writes, in order."""
        return sorted(self.rows.pieces)

    def fill(self, b: int, dst: torch.Tensor) -> int:
        """Copy this rank's pieces of bucket ``b`` into ``dst`` (the whole bucket's buffer); the bytes copied."""
        batch, n = _Batch(), 0
        for p in self.rows.pieces[b]:
            src = self.local[p.tensor]
            if src.device.type == "cpu" and dst.device.type == "cpu":
                ctypes.memmove(dst.data_ptr() + p.offset, src.data_ptr() + p.src, p.nbytes)  # releases the GIL
            else:
                batch.add(dst[p.offset: p.offset + p.nbytes], src[p.src: p.src + p.nbytes])
            n += p.nbytes
        batch.flush()
        return n

    def pack(self, b: int, dst: torch.Tensor) -> int:
        """Copy this rank's pieces of bucket ``b`` one after another into ``dst`` (its piece on
        the wire, ``rows.piece_bytes(b)`` long); the bytes copied."""
        batch, n = _Batch(), 0
        for p in self.rows.pieces[b]:
            src = self.local[p.tensor]
            if src.device.type == "cpu" and dst.device.type == "cpu":
                ctypes.memmove(dst.data_ptr() + n, src.data_ptr() + p.src, p.nbytes)  # releases the GIL
            else:
                batch.add(dst[n: n + p.nbytes], src[p.src: p.src + p.nbytes])
            n += p.nbytes
        batch.flush()
        return n


def unpack_piece(rows: RowPlan, b: int, piece: torch.Tensor, dst: torch.Tensor) -> None:
    """Put the rows of ``rows.rank`` in bucket ``b``, as ``RowWriter.pack`` packed them into
    ``piece``, into their places in ``dst`` (the whole bucket's buffer)."""
    n = 0
    for p in rows.pieces.get(b, ()):
        dst[p.offset: p.offset + p.nbytes].copy_(piece[n: n + p.nbytes])
        n += p.nbytes


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


# -- the bucket plan: a manifest laid out into buckets -------------------------------------------


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
        a delta version's wire plan, its buckets encoded (delta/sender.py)."""
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


# -- packing and unpacking over the plan -------------------------------------------------------


def gaps(bucket: Bucket) -> list[tuple[int, int]]:
    """The byte ranges of ``bucket`` no tensor covers (alignment padding), in order."""
    out, end = [], 0
    for s in sorted(bucket.slices, key=lambda s: s.offset):
        if s.offset > end:
            out.append((end, s.offset))
        end = max(end, s.offset + s.nbytes)
    if bucket.nbytes > end:
        out.append((end, bucket.nbytes))
    return out


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes as integers of its element size (its shape and strides), or None where no
    such type exists (complex128). Batched copies go through these: CUDA's ``_foreach_copy_``
    converts bf16 / fp16 / fp8 elements through float32, which turns every NaN into the one
    canonical NaN (weights are moved bit for bit, NaN payloads included); integers are moved as
    they are."""
    kind = _RAW.get(t.element_size())
    if kind is None:
        return None
    return t if t.dtype == kind else t.view(kind)


def _address(buf: torch.Tensor) -> int:
    """Where a buffer's bytes start: host memory is its own address; a device's accelerator says."""
    return buf.data_ptr() if buf.device.type == "cpu" else devices.address(buf)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    # reshape copies only when the tensor is not contiguous; view(uint8) is free
    return t.reshape(-1).view(torch.uint8)


# Copy and hash in pieces that fit in L2: the hash then reads what the copy just wrote from
# cache instead of a second pass over memory (about a third less time per bucket on CPU).
# Tensors below SMALL are copied in one batch per CHUNK instead (a memmove per tensor costs
# more than its bytes) and hashed behind it.
CHUNK = 512 << 10
SMALL = 64 << 10


class _StreamHash:
    """xxh3 of a host bucket, fed in plan order while the bucket is filled; equals
    ``digest.xxh3(bucket[:nbytes])``. Alignment gaps are hashed too, as they lie in the buffer."""

    def __init__(self, buf: torch.Tensor):
        self.state = xxhash.xxh3_64()
        self.mv = memoryview(buf.numpy())
        self.done = 0

    def upto(self, end: int) -> None:
        if end > self.done:
            self.state.update(self.mv[self.done:end])
            self.done = end

    def digest(self, nbytes: int) -> int:
        self.upto(nbytes)
        return self.state.intdigest()


class _Batch:
    """Copies queued for one batched launch (``torch._foreach_copy_``) instead of one Python
    call per tensor: on a device that is one launch per bucket instead of ~300."""

    def __init__(self) -> None:
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self.nbytes = 0

    def add(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int = 0) -> None:
        self.dst.append(dst)
        self.src.append(src)
        self.nbytes += nbytes

    def flush(self) -> None:
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)
            self.dst, self.src, self.nbytes = [], [], 0


class PackViews:
    """Where each whole tensor of a bucket goes in one buffer (a typed view: a copy into it takes
    the tensor as it is, any strides) and the bucket's alignment gaps. Made once per bucket and
    buffer and reused every version; held by the owner of the buffers (a transport), which drops
    it with them."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, int, int], dict[int, torch.Tensor]] = {}
        self._gaps: dict[tuple[int, int, int], list[torch.Tensor]] = {}

    def of(self, plan: BucketPlan, b: int, buf: torch.Tensor) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
        """(views by tensor index, made as they are asked for; the gaps) of bucket ``b`` in ``buf``."""
        key = (b, _address(buf), buf.numel())
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = {}
            self._gaps[key] = [buf[start:end] for start, end in gaps(plan.buckets[b])]
        return views, self._gaps[key]

    def clear(self) -> None:
        self._views.clear()
        self._gaps.clear()


class Packer:
    """One version's tensors, copied into its bucket plan as a transport asks for each bucket.

    ``fill(b, dst, kind)`` copies every piece of bucket ``b`` into ``dst`` and returns the
    bucket's digest; buckets are asked for in plan order, each once. The tensors are taken from
    ``named`` only as the buckets need them, so an iteration that is itself a collective (FSDP's
    ``full_tensor()`` on every trainer rank) runs as the bytes move, and each tensor is checked
    against the manifest as it arrives (a mismatch is a ManifestError naming the tensor). Filling
    the last bucket checks that no tensor is left over; ``drain()`` walks what is left without
    copying (a version given up part-way: the other trainer ranks are inside the iteration).

    A transport keeps a :class:`PackViews` per set of buffers and passes it to every ``fill``:
    the views it holds are made once, so a version costs one list append per tensor.
    """

    def __init__(self, plan: BucketPlan, manifest: Manifest, named: NamedTensors):
        self.plan, self.manifest = plan, manifest
        specs = manifest.expected
        self._checked = False
        if isinstance(named, Mapping):
            if not _fits_all(specs, named):
                check_names(manifest, named)  # raises, naming the first tensor that is off
            self._checked, named = True, named.items()
        self._items = iter(named)
        self._taken = 0  # tensors taken from the iteration so far
        self._tensor: torch.Tensor | None = None  # the last one taken, while its pieces are packed
        self._flat: torch.Tensor | None = None  # its bytes, flattened once for split pieces
        self._next = 0  # the bucket to fill next
        self.done = False

    def _take(self, i: int) -> torch.Tensor:
        """Tensor ``i`` of the version, from the iteration (tensors come in manifest order)."""
        while self._taken <= i:
            try:
                name, tensor = next(self._items)
            except StopIteration:
                missing = [s.name for s in self.manifest.specs[self._taken:]]
                shown = ", ".join(repr(n) for n in missing[:5])
                raise ManifestError(f"missing tensor(s) {shown}: {len(missing)} of {len(self.manifest)} were "
                                    f"not given") from None
            k = self._taken
            if not self._checked and not _fits(self.manifest.expected, k, name, tensor):
                # the message of what is off: seen are the names before k (each matched its place)
                check_one(self.manifest, k, name, tensor, {s.name for s in self.manifest.specs[:k]})
            self._taken, self._tensor, self._flat = k + 1, tensor, None
        return self._tensor

    def fill(self, b: int, dst: torch.Tensor, kind: str | None = None,
             views: PackViews | None = None) -> int | torch.Tensor | None:
        """Copy bucket ``b`` (the next one) into ``dst`` (uint8, at least its bytes); its digest
        of ``kind`` (None: none): an int, or a 0-dim device tensor for a torch digest on a
        device, whose reading would wait for the device.

        Host to host, big pieces are copied with memmove in cache-sized chunks, each hashed
        right behind its copy; everything else is queued for one batched copy per bucket
        (``_foreach_copy_``: one launch on a device instead of one per tensor).
        """
        if b != self._next:
            raise ValueError(f"bucket {b} asked for out of order: bucket {self._next} is next")
        self._next = b + 1
        bucket = self.plan.buckets[b]
        cached, gap_views = (views or PackViews()).of(self.plan, b, dst)
        if kind is not None and gap_views:
            # a recycled buffer's padding holds an older bucket's bytes: zeroed, the digest
            # depends on the weights only, whichever transport or buffer carried them
            torch._foreach_zero_(gap_views)
        hashed = _StreamHash(dst) if kind == "xxh3" and dst.device.type == "cpu" else None
        batch = _Batch()
        for piece in bucket.slices:
            tensor = self._take(piece.tensor)
            if not piece.nbytes:
                continue
            whole = piece.nbytes == self.manifest[piece.tensor].nbytes
            if (hashed is not None and tensor.device.type == "cpu" and (not whole or piece.nbytes >= SMALL)
                    and tensor.is_contiguous()):
                # host to host: memmove releases the GIL and, unlike torch's copy_, costs nothing per
                # call, so a big tensor can go in cache-sized pieces, each hashed right behind its copy
                batch.flush()  # the hash reads up to this piece: queued copies must have landed
                src_ptr = self._bytes(tensor).data_ptr() + piece.start
                dst_ptr = dst.data_ptr() + piece.offset
                for off in range(0, piece.nbytes, CHUNK):
                    n = min(CHUNK, piece.nbytes - off)
                    ctypes.memmove(dst_ptr + off, src_ptr + off, n)
                    hashed.upto(piece.offset + off + n)
            elif whole and (src := raw(tensor)) is not None:
                into = cached.get(piece.tensor)
                if into is None:
                    window = dst[piece.offset: piece.offset + piece.nbytes]
                    into = cached[piece.tensor] = raw(window.view(tensor.dtype).view(tensor.shape))
                # the tensor as it is (a strided one too): no flat copy, no view of the bucket per version
                batch.add(into, src, piece.nbytes)
                if hashed is not None and batch.nbytes >= CHUNK:  # hashed from cache once landed
                    batch.flush()
                    hashed.upto(piece.offset + piece.nbytes)
            else:  # a split tensor (flattened once, not once per piece), or one without an integer twin
                flat = self._bytes(tensor)
                batch.add(dst[piece.offset: piece.offset + piece.nbytes], flat[piece.start: piece.start + piece.nbytes])
                if hashed is not None:
                    batch.flush()
                    hashed.upto(piece.offset + piece.nbytes)
        batch.flush()
        if b == self.plan.bucket_count - 1:
            self._finish()
        if hashed is not None:
            return hashed.digest(bucket.nbytes)
        return None if kind is None else digests.compute(kind, dst[: bucket.nbytes])

    def _bytes(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._flat is None:
            self._flat = _flat_bytes(tensor)  # reshape copies only when the tensor is not contiguous
        return self._flat

    def _finish(self) -> None:
        """Every bucket is filled: the iteration must be over too (a tensor too many is an error)."""
        self._take(len(self.manifest) - 1)
        extra = next(self._items, None)
        if extra is not None:
            check_one(self.manifest, len(self.manifest), extra[0], extra[1], set())
        self._tensor = self._flat = None
        self.done = True

    def drain(self) -> None:
        """Walk the tensors not taken yet without copying them (the version was given up)."""
        if self.done:
            return
        self.done = True
        self._tensor = self._flat = None
        for _ in self._items:
            pass


def pack(plan: BucketPlan, manifest: Manifest, named: NamedTensors, buffers: Sequence[torch.Tensor],
         kind: str | None = None) -> list[int | torch.Tensor | None]:
    """Every bucket of a version into ``buffers`` (one per bucket), in plan order; the digests
    of ``kind``. For tools and tests that hold a whole version at once."""
    packer = Packer(plan, manifest, named)
    views = PackViews()
    return [packer.fill(b, buffers[b], kind, views) for b in range(plan.bucket_count)]


def _fits(specs: list[tuple[str, torch.dtype, torch.Size]], i: int, name: str, tensor: Any) -> bool:
    """Tensor ``i`` is exactly what the manifest says (a plain dense tensor, not a DTensor): the
    check of an unchanged layout, without building its spec. False: check_one says what is off."""
    if i >= len(specs) or not isinstance(tensor, torch.Tensor):
        return False
    want, dtype, shape = specs[i]
    return (name == want and tensor.dtype is dtype and tensor.shape == shape and tensor.layout is torch.strided
            and not hasattr(tensor, "placements"))


def _fits_all(specs: list[tuple[str, torch.dtype, torch.Size]], named: Mapping[str, Any]) -> bool:
    return len(named) == len(specs) and all(_fits(specs, i, n, t) for i, (n, t) in enumerate(named.items()))


class Unpacker:
    """Turns received buckets back into (name, tensor) pairs, reassembling split tensors.

    Whole tensors come back as views of the bucket buffer: valid only until the transport
    reuses it, which is after ``load_weights`` returned. Split tensors are rebuilt in a
    buffer of their own, allocated once and reused across versions, unless ``span`` gives a
    view of them where they already lie contiguously (a transport that holds the whole
    version, such as shm): then they come back as views too, with no extra copy.

    Split tensors are rebuilt in two arenas, allocated once and used in turn (split tensors in
    plan order alternate), not in a buffer per tensor: with 16 MiB buckets most matrices of a
    1.5B+ model are split, and buffers per tensor added up to a second copy of the model in
    the receiver (on a device: beside the engine's weights and KV cache). Two suffice because
    the pairs of one bucket are loaded before the next bucket is unpacked (the same lifetime
    as a view of the bucket) and a split tensor spans two buckets at least, so the next one of
    the same parity starts only after the previous one was loaded.

    The views of a bucket are made once per buffer that carries it and reused every version
    (a transport's buffers are the same every version: its ring, its slots), so a version costs
    no Python work per tensor here: a bucket's pairs are a list copied, and its split pieces
    one batched copy into the arenas. The views hold their buffer: :meth:`forget` drops them
    when the transport closes or replaces buffers.
    """

    def __init__(self, plan: BucketPlan, manifest: Manifest):
        self.plan = plan
        self.manifest = manifest
        split = sorted((pieces[0].bucket, pieces[0].offset, t) for t, pieces in enumerate(plan.tensor_slices)
                       if len(pieces) > 1)
        self._arena_of = {t: i % 2 for i, (_, _, t) in enumerate(split)}
        self._arena_bytes = [max([manifest[t].nbytes for t, a in self._arena_of.items() if a == k] + [0])
                             for k in (0, 1)]
        self._arenas: dict[tuple[int, torch.device], torch.Tensor] = {}
        # (bucket, where its buffer starts, bytes, whether spans are given) -> what unpacking it takes
        self._views: dict[tuple[int, int, int, bool], _BucketViews] = {}

    def assembly_bytes(self) -> int:
        """Bytes held for rebuilding split tensors (two arenas per device at most)."""
        return sum(a.numel() for a in self._arenas.values())

    def forget(self) -> None:
        """Drop the views made so far (the buffers they show are going away)."""
        self._views.clear()

    def unpack(self, bucket_index: int, buf: torch.Tensor,
               span: Callable[[int, int, int], torch.Tensor | None] | None = None) -> list[tuple[str, torch.Tensor]]:
        """``span(bucket, offset, nbytes)`` returns a view of ``nbytes`` starting at ``offset`` of
        ``bucket`` running on through the following buckets, or None where storage is not
        contiguous. Only called once every bucket of the span was received and verified."""
        key = (bucket_index, _address(buf), buf.numel(), span is not None)
        views = self._views.get(key)
        if views is None:
            views = self._make(bucket_index, buf, span)
            if views.reusable:
                self._views[key] = views
        if views.dst:
            torch._foreach_copy_(views.dst, views.src)  # split pieces into their arenas
        return list(views.pairs)

    def _make(self, bucket_index: int, buf: torch.Tensor,
              span: Callable[[int, int, int], torch.Tensor | None] | None) -> _BucketViews:
        out = _BucketViews()
        for piece in self.plan.buckets[bucket_index].slices:
            spec = self.manifest[piece.tensor]
            dtype = spec.torch_dtype
            if piece.nbytes == spec.nbytes:
                if spec.nbytes == 0:
                    out.pairs.append((spec.name, torch.empty(spec.shape, dtype=dtype, device=buf.device)))
                else:
                    window = buf[piece.offset : piece.offset + piece.nbytes]
                    out.pairs.append((spec.name, window.view(dtype).view(spec.shape)))
                continue
            if span is not None:
                if piece.start + piece.nbytes == spec.nbytes:
                    first = self.plan.tensor_slices[piece.tensor][0]
                    view = span(first.bucket, first.offset, spec.nbytes)
                    if view is not None:
                        out.pairs.append((spec.name, view.view(dtype).view(spec.shape)))
                        continue
                    # not contiguous after all: rebuild from the buckets that are still at hand
                    out.pairs.append((spec.name, self._rebuild(piece.tensor, span)))
                    out.reusable = False  # a copy of this version's bytes
                continue
            k = self._arena_of[piece.tensor]
            arena = self._arenas.get((k, buf.device))
            if arena is None:
                arena = self._arenas[k, buf.device] = torch.empty(self._arena_bytes[k], dtype=torch.uint8,
                                                                   device=buf.device)
            whole = arena[: spec.nbytes]
            out.dst.append(whole[piece.start : piece.start + piece.nbytes])
            out.src.append(buf[piece.offset : piece.offset + piece.nbytes])
            if piece.start + piece.nbytes == spec.nbytes:
                out.pairs.append((spec.name, whole.view(dtype).view(spec.shape)))
        return out

    def _rebuild(self, tensor: int, span: Callable[[int, int, int], torch.Tensor | None]) -> torch.Tensor:
        spec = self.manifest[tensor]
        whole = torch.empty(spec.nbytes, dtype=torch.uint8)
        for p in self.plan.tensor_slices[tensor]:
            part = span(p.bucket, p.offset, p.nbytes)
            if part is None:
                raise RuntimeError(f"tensor {spec.name!r}: the transport can no longer show bucket {p.bucket}")
            whole[p.start : p.start + p.nbytes].copy_(part)
        return whole.view(spec.torch_dtype).view(spec.shape)


@dataclasses.dataclass
class _BucketViews:
    """What unpacking one bucket from one buffer takes: the pairs to load (views of the buffer,
    of a span, of an arena), and the copies of split pieces into their arenas that come first."""

    pairs: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    dst: list[torch.Tensor] = dataclasses.field(default_factory=list)
    src: list[torch.Tensor] = dataclasses.field(default_factory=list)
    reusable: bool = True
