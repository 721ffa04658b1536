"""A simulated asynchronous accelerator, device kind ``sim``: for tests only.

CI has no GPU and no NPU, and on the CPU every copy is synchronous and every event complete
at once, so the branches weightsync takes only on an accelerator (``device.Fences``,
``EventWork``, digests computed on the device and their host copies, device handles in the
ipc ring, loads onto a device, broadcast's event polling) never ran there. Under ``sim`` they
do, with the semantics of CUDA and torch_npu streams and events:

- device memory is host memory (a memfd per allocation, so it can be shared by handle), but
  a tensor on ``sim`` reports ``device.type == "sim"`` and mixing it with a CPU tensor in a
  computation fails as on a device (0-dim CPU scalars excepted, as on CUDA);
- every operation that reads or writes device memory is *queued* on the calling thread's
  current stream and runs later, in stream order, on the stream's own thread, after a seeded
  random lag (``WEIGHTSYNC_SIM_LAG_MS``, default 0-5 ms; ``WEIGHTSYNC_SIM_SEED``): a host
  that reads a buffer (another process through a handle, or a non-blocking copy to the host)
  before the event behind its writes completed sees stale bytes, as it could on a device;
- views and metadata are immediate; an op whose result the host needs (``.item()``,
  ``int(t)``, a blocking copy to the host, ``torch.equal``) synchronizes the stream first,
  as CUDA does;
- ``torch.sim.Event``: ``record()`` marks the stream's queue, ``query()`` stays False until
  the work queued before it ran, ``synchronize()`` waits for it, ``wait(stream)`` makes
  another stream wait (cudaStreamWaitEvent); ``torch.sim.current_stream()``,
  ``synchronize()``, ``Stream``, ``stream(s)`` as in ``torch.cuda``;
- a device tensor is shared between processes by handle: :func:`reduce_tensor` and
  :func:`rebuild_sim_tensor` take and give the arguments of torch's ``rebuild_cuda_tensor``,
  so the ipc transport's handle code (``ipc_wire``) runs unchanged.

The dispatch is torch's Python-only PrivateUse1 backend (``torch.utils.backend_registration``)
renamed ``sim``, with a wrapper subclass holding the host tensor. A process enables it by
resolving the device ``sim`` (``device.resolve``), e.g. ``SyncConfig(device="sim")``.
What it does not model: memory capacity, several devices, peer access, and the speed of
anything (its lags are there to reorder completions, not to time them).
"""

from __future__ import annotations

import collections
import mmap
import os
import random
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

KIND = "sim"
LAG_ENV, SEED_ENV = "WEIGHTSYNC_SIM_LAG_MS", "WEIGHTSYNC_SIM_SEED"
DEFAULT_LAG_MS = 5.0

_enabled = False
_enable_lock = threading.Lock()
aten = torch.ops.aten


# -- streams and events -------------------------------------------------------------------


class Stream:
    """A queue of device work run in order by a thread of its own, each item no earlier than a
    random lag after it was queued: completions come late and in stream order, as on CUDA."""

    def __init__(self, device: Any = None, priority: int = 0, *, seed: Any = None, lag_ms: float | None = None):
        self.device = torch.device(KIND, 0)
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[int, float, Callable[[], None]]] = collections.deque()
        self._issued = self._completed = 0
        self._error: BaseException | None = None
        self._closed = False
        self._rng = _rng() if seed is None else random.Random(seed)
        self._lag_s = _lag_s() if lag_ms is None else lag_ms / 1000.0
        self._thread = threading.Thread(target=self._run, name="sim-stream", daemon=True)
        self._thread.start()
        _streams.add(self)

    def enqueue(self, fn: Callable[[], None]) -> int:
        with self._cv:
            self._issued += 1
            due = time.monotonic() + self._rng.uniform(0.0, self._lag_s)
            self._queue.append((self._issued, due, fn))
            self._cv.notify_all()
            return self._issued

    def mark(self) -> int:
        """The position of the work queued so far (what an event recorded now waits for)."""
        with self._cv:
            return self._issued

    def done_through(self, seq: int) -> bool:
        with self._cv:
            return self._completed >= seq

    def wait_through(self, seq: int) -> None:
        with self._cv:
            while self._completed < seq:
                self._cv.wait(0.05)
            if self._error is not None:
                err, self._error = self._error, None
                raise RuntimeError(f"sim: an asynchronous device operation failed: {err!r}") from err

    def close(self) -> None:
        """Run what is queued, then stop the stream's thread."""
        self.synchronize()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    if self._closed:
                        return
                    self._cv.wait()
                seq, due, fn = self._queue[0]
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            try:
                fn()
            except BaseException as exc:  # surfaces at the next synchronize, as a device's async error
                with self._cv:
                    self._error = self._error or exc
            with self._cv:
                self._queue.popleft()
                self._completed = seq
                self._cv.notify_all()

    # torch.cuda.Stream's surface
    def synchronize(self) -> None:
        self.wait_through(self.mark())

    def query(self) -> bool:
        return self.done_through(self.mark())

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def wait_stream(self, other: Stream) -> None:
        self.wait_event(Event().record(other))

    def record_event(self, event: Event | None = None) -> Event:
        return (event or Event()).record(self)


class Event:
    """``torch.cuda.Event`` on a sim stream."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.stream: Stream | None = None
        self.seq = 0

    def record(self, stream: Stream | None = None) -> Event:
        self.stream = stream or current_stream()
        self.seq = self.stream.mark()
        return self

    def query(self) -> bool:
        return self.stream is None or self.stream.done_through(self.seq)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.wait_through(self.seq)

    def wait(self, stream: Stream | None = None) -> None:
        """Work queued on ``stream`` from now on runs after this event's work."""
        src, seq = self.stream, self.seq
        if src is None:
            return
        (stream or current_stream()).enqueue(lambda: src.wait_through(seq))


_default: Stream | None = None
_local = threading.local()


def default_stream(device: Any = None) -> Stream:
    global _default
    with _enable_lock:
        if _default is None:
            _default = Stream()
        return _default


def current_stream(device: Any = None) -> Stream:
    return getattr(_local, "stream", None) or default_stream()


def set_stream(stream: Stream) -> None:
    _local.stream = stream


@contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    prev = getattr(_local, "stream", None)
    _local.stream = s
    try:
        yield
    finally:
        _local.stream = prev


_streams: weakref.WeakSet[Stream] = weakref.WeakSet()


def synchronize(device: Any = None) -> None:
    """Wait for every stream of the device."""
    for s in [default_stream(), *list(_streams)]:
        s.synchronize()


def _rng() -> random.Random:
    seed = os.environ.get(SEED_ENV)
    return random.Random(f"{seed}:{os.getpid()}:{threading.get_ident()}" if seed is not None else None)


def _lag_s() -> float:
    return float(os.environ.get(LAG_ENV, DEFAULT_LAG_MS)) / 1000.0


def configure(lag_ms: float | None = None, seed: int | None = None) -> None:
    """Set this process's lag and seed (a test in one process); streams made from now on use them."""
    if lag_ms is not None:
        os.environ[LAG_ENV] = str(lag_ms)
    if seed is not None:
        os.environ[SEED_ENV] = str(seed)


def reset_streams() -> None:
    """New default stream with the current lag and seed (the old one finishes its queue first)."""
    global _default
    old = _default
    with _enable_lock:
        _default = None
    _local.stream = None
    if old is not None:
        old.close()


# -- memory ---------------------------------------------------------------------------------

_blocks: dict[int, tuple[int, int]] = {}  # mapping address -> (memfd, bytes): what reduce_tensor shares


def _close_block(addr: int, fd: int) -> None:
    _blocks.pop(addr, None)
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
    if isinstance(x, SimTensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
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
        s.enqueue(lambda: func(*hargs, **hkwargs))
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        crosses = any(not isinstance(t, SimTensor) for t in [*args[0], *args[1]])
        if blocking and crosses:
            s.synchronize()  # copies to or from the host return once done, as copy_ does
        return None
    _check_devices(func, args, kwargs)
    if _writes(func):  # in place (out= included): queued; the arguments it writes are its result
        current_stream().enqueue(lambda: func(*hargs, **hkwargs))
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
    return spec.unflatten(allocated) if hasattr(spec, "unflatten") else torch.utils._pytree.tree_unflatten(allocated, spec)


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


def reduce_tensor(t: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    """(rebuild, args) for a sim tensor, in the order of torch's ``rebuild_cuda_tensor``."""
    if not isinstance(t, SimTensor):
        raise TypeError(f"sim: not a sim tensor: {type(t).__name__}")
    host = t.host
    base = host.untyped_storage().data_ptr()
    block = _blocks.get(base)
    if block is None:
        raise RuntimeError("sim: this tensor's memory was not allocated on the sim device (not shareable)")
    fd, size = block
    handle = f"{os.getpid()}:{fd}".encode()
    return rebuild_sim_tensor, (torch.Tensor, tuple(host.size()), tuple(host.stride()), host.storage_offset(),
                                torch.UntypedStorage, host.dtype, 0, handle, size, 0, False, None, 0, None, False)


def rebuild_sim_tensor(tensor_cls: Any, tensor_size: Any, tensor_stride: Any, tensor_offset: int, storage_cls: Any,
                       dtype: torch.dtype, storage_device: int, storage_handle: bytes, storage_size_bytes: int,
                       storage_offset_bytes: int, requires_grad: bool, ref_counter_handle: Any,
                       ref_counter_offset: int, event_handle: Any, event_sync_required: bool) -> torch.Tensor:
    """Open another process's sim tensor from :func:`reduce_tensor`'s arguments."""
    enable()
    pid, fd = (int(x) for x in storage_handle.decode().split(":"))
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        mm = mmap.mmap(own, storage_size_bytes)
    finally:
        os.close(own)
    raw = torch.frombuffer(mm, dtype=torch.uint8)[storage_offset_bytes:]
    return SimTensor(raw.view(dtype).as_strided(list(tensor_size), list(tensor_stride), tensor_offset))


# -- the collective -------------------------------------------------------------------------


class Communicator:
    """The sim device's collective (backend ``simccl``): a broadcast queued on the device's
    current stream and seen through an event, as vLLM's PyNcclCommunicator and vllm-ascend's
    PyHcclCommunicator queue theirs (transports/communicators.py ``_StatelessComm``); gloo
    moves the host bytes behind the device tensors when the stream gets there."""

    def __init__(self, pg: Any, device: torch.device):
        self.pg, self.device = pg, device

    def broadcast(self, tensor: torch.Tensor, timeout: float) -> Any:
        import datetime

        import torch.distributed as dist

        from .device import EventWork

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=max(timeout, 0.001))
        host, pg = tensor.host, self.pg
        current_stream().enqueue(lambda: pg.broadcast([host], opts).wait())
        return EventWork(self.device)

    def abort(self) -> None:
        self.pg.abort()


# -- enabling ---------------------------------------------------------------------------------


def _module() -> types.ModuleType:
    m = types.ModuleType(f"torch.{KIND}")
    m.is_available = lambda: True
    m.device_count = lambda: 1
    m.current_device = lambda: 0
    m.set_device = lambda device: None
    m._is_in_bad_fork = lambda: False
    m.manual_seed_all = lambda seed: None
    m.get_rng_state = lambda device=None: torch.empty(0, dtype=torch.uint8)
    m.set_rng_state = lambda state, device=None: None
    m.is_initialized = lambda: True
    m.Stream, m.Event = Stream, Event
    m.current_stream, m.default_stream, m.set_stream, m.stream = current_stream, default_stream, set_stream, stream
    m.synchronize = synchronize
    return m


def enable() -> None:
    """Register the ``sim`` device in this process (idempotent)."""
    global _enabled, _library
    with _enable_lock:
        if _enabled:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if torch._C._get_privateuse1_backend_name() not in ("privateuseone", KIND):
            raise RuntimeError(f"sim: PrivateUse1 is taken by {torch._C._get_privateuse1_backend_name()!r}")
        if torch._C._get_privateuse1_backend_name() != KIND:
            _setup_privateuseone_for_python_backend(rename=KIND, backend_module=_module())
        _library = torch.library.Library("aten", "IMPL")
        _library.impl("empty.memory_format", _empty, "PrivateUse1")
        _library.impl("empty_strided", _empty_strided, "PrivateUse1")
        _library.impl("_copy_from", _copy_from, "PrivateUse1")
        _library.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
        _enabled = True


_library: Any = None
