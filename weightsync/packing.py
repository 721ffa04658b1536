"""Internal. Moving a version's bytes in and out of its bucket plan (manifest.py): the sender packs
its tensors into bucket buffers while one streaming digest covers them, a receiver unpacks a
bucket into its model's tensors, both as views and batched copies made once per session so the
host's work per version does not grow with the tensor count.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import xxhash

from . import device as devices
from . import digest as digests
from .errors import ManifestError
from .manifest import Bucket, BucketPlan, Manifest, check_names, check_one


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
    """Where each piece of a bucket goes in one buffer: the windows of split pieces, a typed
    view for each whole tensor (a copy into it takes the tensor as it is, any strides), the
    alignment gaps. Made once per bucket and buffer and reused every version, so packing a
    version costs one list append per tensor; held by the owner of the buffers (a transport's
    sink, ``BucketSink.views``), which drops it with them."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, int, int], dict[int, torch.Tensor]] = {}
        self._gaps: dict[tuple[int, int, int], list[torch.Tensor]] = {}

    def of(self, plan: BucketPlan, b: int, buf: torch.Tensor) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
        """(views by tensor index, made as they are asked for; the gaps) of bucket ``b`` in ``buf``."""
        key = (b, devices.address(buf), buf.numel())
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = {}
            self._gaps[key] = [buf[start:end] for start, end in gaps(plan.buckets[b])]
        return views, self._gaps[key]

    def clear(self) -> None:
        self._views.clear()
        self._gaps.clear()


class BucketSink(abc.ABC):
    """Where pack_stream puts a version: a transport's bucket buffers. ``views``: the transport's
    PackViews of those buffers (None: made anew every version)."""

    views: PackViews | None = None

    @abc.abstractmethod
    def buffer(self, b: int) -> torch.Tensor:
        """The uint8 destination of bucket ``b`` (``plan.buckets[b].nbytes`` or more). Asked
        once per bucket in plan order, once every earlier bucket is complete: a transport may
        hand out a recycled buffer and publish the buckets before ``b`` here."""

    def done(self, b: int, digest: int | torch.Tensor | None) -> None:
        """Bucket ``b``'s last byte is in, before the next buffer is asked for. ``digest``: of
        pack_stream's ``kind`` over its bytes (an int, or a 0-dim device tensor for torch)."""


class Buffers(BucketSink):
    """A sink over ``buffer(b)`` that keeps each bucket's digest in ``digests``."""

    def __init__(self, buffer: Callable[[int], torch.Tensor], digests: dict[int, Any] | None = None):
        self._buffer, self.digests = buffer, {} if digests is None else digests

    def buffer(self, b: int) -> torch.Tensor:
        return self._buffer(b)

    def done(self, b: int, digest: int | torch.Tensor | None) -> None:
        if digest is not None:
            self.digests[b] = digest


@dataclasses.dataclass(frozen=True)
class Packing:
    """One version's tensors, packed when the transport asks (in stage() or send())."""

    plan: BucketPlan
    manifest: Manifest
    named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

    def into(self, sink: BucketSink, kind: str | None) -> Iterator[int]:
        return pack_stream(self.plan, self.manifest, self.named, sink, kind)


def pack_stream(plan: BucketPlan, manifest: Manifest,
                named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                sink: BucketSink, kind: str | None = None) -> Iterator[int]:
    """Copy tensors into their buckets in plan order, yielding each bucket index once full.

    Bucket ``b`` goes to ``sink.buffer(b)``; ``sink.done(b, digest)`` follows once its last
    byte is in. Tensors are checked against the manifest as they arrive; a mismatch raises
    ManifestError naming the tensor. With a ``kind``, each bucket's digest (see digest/) is
    computed as it is filled: an xxh3 of a host bucket piece by piece from cache, a torch
    digest on the bucket's device. Copies from a device, and host copies that are not hashed
    as they go, are batched: one ``_foreach_copy_`` per bucket, issued before the next
    bucket is asked for.
    """
    specs = manifest.expected
    checked = False
    if isinstance(named, Mapping):
        if not _fits_all(specs, named):
            check_names(manifest, named)  # raises, naming the first tensor that is off
        checked, named = True, named.items()
    last_of_bucket = {b.index: max((s.tensor for s in b.slices), default=-1) for b in plan.buckets}
    ready_after: dict[int, list[int]] = {}
    for b, last in last_of_bucket.items():
        ready_after.setdefault(last, []).append(b)
    # a bucket's checksum is final once its last piece is in, before the next bucket is asked
    # for: a transport may publish a bucket then, before pack_stream yields it
    last_piece = {b.index: b.slices[-1] for b in plan.buckets if b.slices}
    cache = getattr(sink, "views", None) or PackViews()  # a sink of another kind keeps none
    buffers: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
    hashes: dict[int, _StreamHash] = {}
    batch = _Batch()
    i = -1
    for i, (name, tensor) in enumerate(named):
        if not checked and not _fits(specs, i, name, tensor):
            # the message of what is off: seen are the names before i (each matched its place)
            check_one(manifest, i, name, tensor, {s.name for s in manifest.specs[:i]})
        pieces = plan.tensor_slices[i]
        flat = None
        for piece in pieces:
            got = buffers.get(piece.bucket)
            if got is None:
                batch.flush()  # every earlier bucket is complete when this one is asked for
                dst = sink.buffer(piece.bucket)
                views, gap_views = cache.of(plan, piece.bucket, dst)
                got = buffers[piece.bucket] = (dst, views)
                if kind is not None and gap_views:
                    # a recycled buffer's padding holds an older bucket's bytes: zeroed, the
                    # digest depends on the weights only, whichever transport or buffer carried them
                    torch._foreach_zero_(gap_views)
                if kind == "xxh3" and dst.device.type == "cpu":
                    hashes[piece.bucket] = _StreamHash(dst)
            dst, views = got
            hashed = hashes.get(piece.bucket)
            if not piece.nbytes:
                pass
            elif (hashed is not None and tensor.device.type == "cpu" and (len(pieces) > 1 or piece.nbytes >= SMALL)
                  and tensor.is_contiguous()):
                # host to host: memmove releases the GIL and, unlike torch's copy_, costs nothing per
                # call, so a big tensor can go in cache-sized pieces, each hashed right behind its copy
                batch.flush()  # the hash reads up to this piece: queued copies must have landed
                if flat is None:
                    flat = _flat_bytes(tensor)
                src_ptr, dst_ptr = flat.data_ptr() + piece.start, dst.data_ptr() + piece.offset
                for off in range(0, piece.nbytes, CHUNK):
                    n = min(CHUNK, piece.nbytes - off)
                    ctypes.memmove(dst_ptr + off, src_ptr + off, n)
                    hashed.upto(piece.offset + off + n)
            elif len(pieces) == 1 and (src := raw(tensor)) is not None:
                into = views.get(i)
                if into is None:
                    window = dst[piece.offset: piece.offset + piece.nbytes]
                    into = views[i] = raw(window.view(tensor.dtype).view(tensor.shape))
                # the tensor as it is (a strided one too): no flat copy, no view of the bucket per version
                batch.add(into, src, piece.nbytes)
                if hashed is not None and batch.nbytes >= CHUNK:  # hashed from cache once landed
                    batch.flush()
                    hashed.upto(piece.offset + piece.nbytes)
            else:  # a split tensor (flattened once, not once per piece), or one without an integer twin
                if flat is None:
                    flat = _flat_bytes(tensor)
                batch.add(dst[piece.offset: piece.offset + piece.nbytes], flat[piece.start: piece.start + piece.nbytes])
                if hashed is not None:
                    batch.flush()
                    hashed.upto(piece.offset + piece.nbytes)
            if piece is last_piece[piece.bucket]:
                nbytes = plan.buckets[piece.bucket].nbytes
                batch.flush()
                if hashed is not None:
                    sink.done(piece.bucket, hashes.pop(piece.bucket).digest(nbytes))
                else:
                    sink.done(piece.bucket, None if kind is None else digests.compute(kind, dst[:nbytes]))
        for b in ready_after.get(i, ()):
            batch.flush()
            buffers.pop(b, None)
            yield b
    batch.flush()
    if i + 1 < len(manifest):
        missing = [s.name for s in manifest.specs[i + 1 :]]
        shown = ", ".join(repr(n) for n in missing[:5])
        raise ManifestError(f"missing tensor(s) {shown}: {len(missing)} of {len(manifest)} were not given")


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
        key = (bucket_index, devices.address(buf), buf.numel(), span is not None)
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
