"""The sim device's memory and tensors (weightsync_sim): a wrapper subclass whose ``host``
tensor holds the bytes (a memfd per allocation, so it can be shared by handle), and the
dispatch that queues every operation on device memory on the current stream."""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .streams import KIND, current_stream

aten = torch.ops.aten

# -- memory ---------------------------------------------------------------------------------

_blocks: dict[int, tuple[int, int]] = {}  # mapping address -> (memfd, bytes): what reduce_tensor shares


_blocks_lock = threading.Lock()


def _close_block(addr: int, fd: int) -> None:
    # CPython unmaps an mmap (GIL released) before it calls its finalizers: another thread may
    # have mapped a new block at the same address meanwhile. Its fd differs (ours is still open
    # until below), so only our own entry goes.
    with _blocks_lock:
        if _blocks.get(addr, (None, 0))[0] == fd:
            del _blocks[addr]
    try:
        os.close(fd)
    except OSError:
        pass


def _host_alloc(nbytes: int) -> torch.Tensor:
    """``nbytes`` of "device memory": a memfd mapped here, shareable with other processes."""
    size = max(nbytes, 1)
    fd = os.memfd_create("weightsync-sim", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    buf = torch.frombuffer(mm, dtype=torch.uint8)  # keeps the mapping alive as long as the storage
    addr = buf.data_ptr()
    with _blocks_lock:
        _blocks[addr] = (fd, size)
    weakref.finalize(mm, _close_block, addr, fd)
    return buf


def _empty_host(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
    size, dtype = list(size), dtype or torch.get_default_dtype()
    if stride is None:
        stride = _contiguous_strides(size)
    extent = 1 + sum((s - 1) * st for s, st in zip(size, stride)) if all(size) else 0
    raw = _host_alloc(extent * torch.empty((), dtype=dtype).element_size())
    return raw.view(dtype).as_strided(size, list(stride)) if extent else raw[:0].view(dtype).as_strided(size, list(stride))


def _contiguous_strides(size: list[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return list(reversed(strides))


# -- the tensor -----------------------------------------------------------------------------


class SimTensor(torch.Tensor):
    """A tensor on the sim device: a wrapper whose ``host`` tensor holds the bytes."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> SimTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, host.size(), strides=host.stride(),
                                                storage_offset=host.storage_offset(), dtype=host.dtype,
                                                device=torch.device(KIND, 0), requires_grad=False)
        t.host = host
        return t

    def __repr__(self) -> str:  # reading the values would be a synchronize
        return f"SimTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _dispatch(func, args, kwargs or {})


def _host(x: Any) -> Any:
    return x.host if isinstance(x, SimTensor) else x


def _wrap(x: Any) -> Any:
    return SimTensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, SimTensor) else x


def _meta(x: Any) -> Any:
    """A tensor argument (sim or a host scalar) as a meta tensor of its shape, for shape inference."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    return x


# ops whose result the host reads: the stream is drained first, as CUDA's implicit synchronize
_HOST_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}


def _writes(func: Any) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _is_view(func: Any) -> bool:
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _check_devices(func: Any, args: Any, kwargs: Any) -> None:
    """A computation mixing device and host tensors fails, as on CUDA (0-dim host scalars pass)."""
    leaves, _ = tree_flatten((args, kwargs))
    for x in leaves:
        if isinstance(x, torch.Tensor) and not isinstance(x, SimTensor) and x.device.type != "meta" and x.dim() > 0:
            raise RuntimeError(f"sim: {func} got a {x.device.type} tensor beside sim tensors: expected all tensors "
                               f"to be on the same device")


def _dispatch(func: Any, args: Any, kwargs: Any) -> Any:
    if func in _HOST_READS:
        current_stream().synchronize()
        return func(*tree_map(_host, args), **tree_map(_host, kwargs))
    if func is aten.copy_.default:
        return _copy(args[0], args[1], bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False)))
    if func is aten._to_copy.default:
        return _to_copy(args[0], kwargs)
    if _is_view(func):  # metadata only: at once, sharing the bytes
        return tree_map(_wrap, func(*tree_map(_host, args), **tree_map(_host, kwargs)))
    hargs, hkwargs = tree_map(_host, args), tree_map(_host, kwargs)
    if func is aten._foreach_copy_.default:
        s = current_stream()
        s.enqueue(lambda: _foreach_copy(args, hargs[0], hargs[1]))
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        crosses = any(not isinstance(t, SimTensor) for t in [*args[0], *args[1]])
        if blocking and crosses:
            s.synchronize()  # copies to or from the host return once done, as copy_ does
        return None
    _check_devices(func, args, kwargs)
    if _writes(func):  # in place (out= included): queued; the arguments it writes are its result
        current_stream().enqueue(lambda: func(*hargs, **hkwargs))
        if not func._schema.returns:  # the in-place foreach ops (_foreach_zero_ & co.) return nothing
            return None
        written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        named = dict(zip([a.name for a in func._schema.arguments], args)) | kwargs
        outs = [named[n] for n in written if n in named]
        return outs[0] if len(outs) == 1 else tuple(outs)
    # a new tensor: its shape from the meta kernel now, its values when the stream runs
    try:
        meta_out = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
    except (NotImplementedError, RuntimeError):
        current_stream().synchronize()
        return tree_map(_wrap, func(*hargs, **hkwargs))
    outs_meta, spec = tree_flatten(meta_out)
    allocated = [SimTensor(_empty_host(m.size(), m.stride(), m.dtype)) if isinstance(m, torch.Tensor) else m
                 for m in outs_meta]

    def run() -> None:
        got, _ = tree_flatten(func(*hargs, **hkwargs))
        for a, g in zip(allocated, got):
            if isinstance(a, SimTensor):
                a.host.copy_(g)

    current_stream().enqueue(run)
    return tree_unflatten(allocated, spec)


# CUDA's _foreach_copy_ kernel (its fast path: every tensor on one device, one dtype, the same
# sizes and strides pairwise) computes in the dtype's opmath type: these go through float32 and
# back, which makes every NaN the canonical one. Modelled, so a batched copy that would lose NaN
# payloads on a GPU loses them here too
_THROUGH_FLOAT = {torch.float16, torch.bfloat16} | {getattr(torch, n) for n in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz") if hasattr(torch, n)}


def _foreach_copy(args: Any, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    fast = (all(isinstance(t, SimTensor) for t in [*args[0], *args[1]])
            and len({t.dtype for t in [*dst, *src]}) == 1
            and all(d.size() == s.size() and d.stride() == s.stride() for d, s in zip(dst, src)))
    for d, s in zip(dst, src):
        d.copy_(s.float() if fast and d.dtype in _THROUGH_FLOAT else s)


def _copy(dst: Any, src: Any, non_blocking: bool) -> Any:
    s = current_stream()
    if isinstance(dst, SimTensor):
        d, h = dst.host, _host(src)
        s.enqueue(lambda: d.copy_(h))
        if not isinstance(src, SimTensor) and not non_blocking:
            s.synchronize()  # a blocking copy from the host returns once it is done
        return dst
    # device to host
    h = src.host
    if non_blocking:
        s.enqueue(lambda: dst.copy_(h))  # lands when the stream gets there: read it after an event
    else:
        s.synchronize()
        dst.copy_(h)
    return dst


def _to_copy(x: Any, kwargs: dict[str, Any]) -> Any:
    device = kwargs.get("device")
    target = torch.device(device) if device is not None else (x.device if isinstance(x, torch.Tensor) else None)
    dtype = kwargs.get("dtype") or x.dtype
    if target is not None and target.type != KIND:  # to the host
        out = torch.empty(x.size(), dtype=dtype, device=target)
        return _copy(out, x, bool(kwargs.get("non_blocking", False)))
    out = SimTensor(_empty_host(x.size(), None, dtype))
    return _copy(out, x, bool(kwargs.get("non_blocking", False)))


# -- factories (the PrivateUse1 kernels) -------------------------------------------------------


def _empty(size: Any, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None,
           memory_format: Any = None) -> SimTensor:
    return SimTensor(_empty_host(size, None, dtype))


def _empty_strided(size: Any, stride: Any, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> SimTensor:
    return SimTensor(_empty_host(size, stride, dtype))


def _copy_from(self: Any, dst: Any, non_blocking: bool = False) -> Any:
    """Copies torch makes below the Python dispatch (``torch.tensor(data, device="sim")``)."""
    return _copy(dst, self, non_blocking)


def _copy_from_and_resize(self: Any, dst: Any) -> Any:
    return _copy(dst, self, False)


# -- sharing by handle (the arguments of torch's rebuild_cuda_tensor) ---------------------------


def reduce_args(t: torch.Tensor) -> tuple[Any, ...]:
    """A sim tensor's handle: the arguments of torch's ``rebuild_cuda_tensor``, in its order."""
    if not isinstance(t, SimTensor):
        raise TypeError(f"sim: not a sim tensor: {type(t).__name__}")
    host = t.host
    base = host.untyped_storage().data_ptr()
    block = _blocks.get(base)
    if block is None:
        raise RuntimeError("sim: this tensor's memory was not allocated on the sim device (not shareable)")
    fd, size = block
    handle = f"{os.getpid()}:{fd}".encode()
    return (torch.Tensor, tuple(host.size()), tuple(host.stride()), host.storage_offset(), torch.UntypedStorage,
            host.dtype, 0, handle, size, 0, False, None, 0, None, False)


def rebuild(tensor_cls: Any, tensor_size: Any, tensor_stride: Any, tensor_offset: int, storage_cls: Any,
                       dtype: torch.dtype, storage_device: int, storage_handle: bytes, storage_size_bytes: int,
                       storage_offset_bytes: int, requires_grad: bool, ref_counter_handle: Any,
                       ref_counter_offset: int, event_handle: Any, event_sync_required: bool) -> torch.Tensor:
    """Open another process's sim tensor from :func:`reduce_args`."""
    pid, fd = (int(x) for x in storage_handle.decode().split(":"))
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        mm = mmap.mmap(own, storage_size_bytes)
    finally:
        os.close(own)
    raw = torch.frombuffer(mm, dtype=torch.uint8)[storage_offset_bytes:]
    return SimTensor(raw.view(dtype).as_strided(list(tensor_size), list(tensor_stride), tensor_offset))
