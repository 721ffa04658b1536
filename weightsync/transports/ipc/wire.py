"""Internal. What crosses the process boundary in the ipc transport: device handles as plain data, and
the control block's words.

Handles cross the process boundary as plain msgpack data: ``reduce_tensor`` (torch_npu
patches it for NPU) returns a rebuild function and its arguments; we ship the arguments'
values only (sizes, dtype name, handle bytes) and the receiver calls a rebuild function
from a fixed allowlist, so nothing is ever unpickled. The device index in a handle is the
sender's logical index; it is sent as a physical id and mapped back to the receiver's own
numbering (Ray actors see renumbered devices through *_VISIBLE_DEVICES).

Handshakes run through a small host control segment (uint64 words), no
coordinator round trip per bucket:
  [0] magic [1] layout digest [2] buffer count [3] receiver slots [4] sender pid [5] digest kind
  [6] release doorbell: a receiver bumps it after every release word it writes and wakes the
      sender sleeping on it (transports/shm/transport.py: wake)
  [16 + 4k] ready word of buffer k: tag(version, bucket) once written, 0 while being written
  [17 + 4k] digest of the bucket in buffer k: xxh3 for host buffers, the torch digest computed
            on the device for device buffers (digest: auto), so device ipc is verified too
  [48 + 16r] receiver slot r: owner (hash of the receiver's name), [+1] pid,
             [+2 + k] tag of the last bucket the receiver finished with in buffer k
  [ROSTER] version + 1 of the roster below, [+1] its length, [+2 ...] the owner words of the
           receivers the sender waits for in that version: written before its first bucket is
           published, so a receiver learns whether it takes part without asking the coordinator
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import torch
import xxhash

from ... import device as devices
from ...errors import CapacityError, ConfigError, ProtocolError, VersionError
from ...manifest import dtype_name, dtype_of
from ...records import State
from .. import Aborted, TransportContext
from .records import DeviceHandle


def _rebuild(kind: str) -> tuple[str, str] | None:
    """The one function a receiver may call to open a handle of ``kind`` (module, name), as its
    accelerator registered it (device.Accelerator.rebuild); nothing else is ever invoked."""
    acc = devices.accelerator(kind)
    return acc.rebuild if acc is not None else None

# what reduce_tensor returns for a device tensor: the arguments of torch's rebuild_cuda_tensor
# and torch_npu's rebuild_npu_tensor, by their parameter names (tests/conformance checks both)
HANDLE_ARGS = ("tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls", "dtype",
               "storage_device", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "requires_grad",
               "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")


def export_handle(t: torch.Tensor) -> DeviceHandle:
    """A device tensor's IPC handle, as the record that crosses to the receivers."""
    from torch.multiprocessing import reductions  # looked up now: torch_npu patches it on import

    kind = t.device.type
    acc = devices.accelerator(kind)
    rebuild, args = (acc.reduce if acc is not None and acc.reduce is not None else reductions.reduce_tensor)(t)
    if (getattr(rebuild, "__module__", ""), getattr(rebuild, "__name__", "")) != _rebuild(kind):
        raise ProtocolError(f"ipc: {kind} tensors reduce through {rebuild!r}, not an IPC handle this version "
                            f"of weightsync knows; use transport 'shm'")
    if len(args) != len(HANDLE_ARGS):
        raise ProtocolError(f"ipc: {rebuild.__name__} takes {len(args)} arguments here, not the {len(HANDLE_ARGS)} "
                            f"this version of weightsync knows; use transport 'shm'")
    a = dict(zip(HANDLE_ARGS, args))
    ref, event = a["ref_counter_handle"], a["event_handle"]
    return DeviceHandle(
        kind=kind, physical=devices.physical_index(torch.device(kind, int(a["storage_device"]))),
        size=[int(x) for x in a["tensor_size"]], stride=[int(x) for x in a["tensor_stride"]],
        offset=int(a["tensor_offset"]), typed=a["storage_cls"] is torch.storage.TypedStorage,
        dtype=dtype_name(a["dtype"]), handle=bytes(a["storage_handle"]),
        storage_bytes=int(a["storage_size_bytes"]), storage_offset=int(a["storage_offset_bytes"]),
        ref_handle=None if ref is None else bytes(ref), ref_offset=int(a["ref_counter_offset"] or 0),
        event=None if event is None else bytes(event), event_sync=bool(a["event_sync_required"]),
    )


def import_handle(h: DeviceHandle) -> torch.Tensor:
    """Open a handle from :func:`export_handle` (its fields checked where the record was parsed)
    on this process's view of the same device."""
    kind = h.kind
    if _rebuild(kind) is None:
        raise ProtocolError(f"ipc handle of unknown kind {kind!r}")
    physical = h.physical
    local = devices.local_index(kind, physical)
    if local is None:
        var = devices.visible_devices_var(kind)
        raise ProtocolError(f"ipc: the sender's buffers are on physical {kind} {physical}, which this receiver "
                            f"cannot see ({var}={os.environ.get(var or '', '')!r}); ipc needs both on one device")
    module, name = _rebuild(kind)
    rebuild = getattr(importlib.import_module(module), name)
    return rebuild(
        tensor_cls=torch.Tensor, tensor_size=torch.Size(h.size), tensor_stride=tuple(h.stride),
        tensor_offset=h.offset, storage_cls=torch.storage.TypedStorage if h.typed else torch.UntypedStorage,
        dtype=dtype_of(h.dtype), storage_device=local, storage_handle=h.handle,
        storage_size_bytes=h.storage_bytes, storage_offset_bytes=h.storage_offset, requires_grad=False,
        ref_counter_handle=h.ref_handle, ref_counter_offset=h.ref_offset,
        event_handle=h.event, event_sync_required=h.event_sync,
    )


def check_nd(t: torch.Tensor) -> None:
    if t.device.type != "npu":
        return
    fmt = devices.npu_format(t)
    if fmt != devices.ACL_FORMAT_ND:
        raise CapacityError(f"ipc: the bucket buffer has NPU format {fmt}, not ND; FRACTAL_NZ and other private "
                            f"formats cannot be shared by handle (set VLLM_ASCEND_ENABLE_NZ=0)")


# -- the control block ------------------------------------------------------------------------

# How many bucket buffers a streaming transport keeps in flight: ipc's ring, shm's streaming
# ring (at most; its budget may allow fewer) and broadcast's buffers per side. Two is the
# default everywhere: one buffer being written while the other is read. The choice is measured,
# per transport, on the 2-core VM (docs/benchmarks.md, "Ring depth"); WEIGHTSYNC_RING_BUFFERS
# overrides it in every process that imports the transports, to repeat that measurement (the
# benchmark's parties inherit it from the driver's environment). The control block has room
# for MAX_BUFFERS, so that is the most any override may ask for.
RING_ENV = "WEIGHTSYNC_RING_BUFFERS"
MAX_BUFFERS = 8


def in_flight(default: int) -> int:
    """``default``, or the override from the environment (1 .. MAX_BUFFERS)."""
    raw = os.environ.get("WEIGHTSYNC_RING_BUFFERS", "")
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_BUFFERS:
        raise ConfigError(f"{RING_ENV}={raw!r}: buffers in flight must be an integer from 1 to {MAX_BUFFERS}")
    return n


MAGIC = 0x5753594E43495032  # "WSYNCIP2": with the roster (a sender without one is another version)
NBUF = in_flight(2)  # ring depth
RELEASED = 6
MAX_RECEIVERS = 256
BUF0, BUF_WORDS = 16, 4
SLOT0, SLOT_WORDS = BUF0 + MAX_BUFFERS * BUF_WORDS, 16
ROSTER = SLOT0 + MAX_RECEIVERS * SLOT_WORDS
CONTROL_BYTES = (ROSTER + 2 + MAX_RECEIVERS) * 8
BUCKET_BITS = 24
KIND_CODE = {None: 0, "xxh3": 1, "torch": 2}


def tag(version: int, bucket: int) -> int:
    """One monotonic word per (version, bucket): later buckets and versions compare larger."""
    return ((version + 1) << BUCKET_BITS) | bucket


def owner_word(name: str) -> int:
    return xxhash.xxh3_64_intdigest(name.encode()) | 1  # never 0, which marks a free slot


def ready_word(k: int) -> int:
    return BUF0 + BUF_WORDS * k


def slot_word(r: int) -> int:
    return SLOT0 + SLOT_WORDS * r


def find_slot(words: np.ndarray, owner: int) -> int | None:
    owners = words[SLOT0::SLOT_WORDS][:MAX_RECEIVERS]
    hit = np.flatnonzero(owners == np.uint64(owner))
    return int(hit[0]) if hit.size else None


# -- whom the sender waits for ----------------------------------------------------------------

class Watch:
    """The sender's view of who takes part in a version: the participants the barrier named
    (the sender's own begin_sync reply, no call of its own), refreshed from the coordinator
    only while it waits longer than a tick."""

    def __init__(self, ctx: TransportContext, version: int):
        self.ctx, self.version = ctx, version
        self.names: list[str] = []
        self.done: set[str] = set()
        self.known = ctx.control is not None
        self.slots: dict[str, int] = {}
        barrier = ctx.control.barrier(version) if self.known else None
        if barrier is not None:
            self.names, self.done = list(barrier.participants), set(barrier.failed)
        else:
            self.refresh()

    def refresh(self) -> None:
        if not self.known:
            return
        m = self.ctx.control.metrics(self.version)
        if m.state == State.ABORTED:
            raise Aborted(f"version {self.version} was aborted: {m.reason}")
        self.names = list(m.participants)
        self.done = set(m.failed) | set(m.committed)

    def write_roster(self, words: np.ndarray) -> None:
        """Tell the receivers whom this version waits for (before its first bucket is published)."""
        if not self.known:
            return
        waited = [owner_word(n) for n in self.names if n not in self.done][:MAX_RECEIVERS]
        words[ROSTER + 2: ROSTER + 2 + len(waited)] = waited
        words[ROSTER + 1] = len(waited)
        words[ROSTER] = self.version + 1

    def pending(self, words: np.ndarray, need: int, k: int) -> list[str]:
        """Receivers still holding the bucket tagged ``need`` in buffer ``k``."""
        if not self.known:  # no coordinator: wait for every receiver attached to the block
            owners = words[SLOT0::SLOT_WORDS][:MAX_RECEIVERS]
            return [f"slot {r}" for r in np.flatnonzero(owners)
                    if int(words[slot_word(int(r)) + 2 + k]) < need]
        out = []
        for name in self.names:
            if name in self.done:
                continue
            r = self.slots.get(name)
            if r is None:
                r = find_slot(words, owner_word(name))
                if r is None:
                    out.append(name)  # not attached yet: it still has every bucket to read
                    continue
                self.slots[name] = r
            if int(words[slot_word(r) + 2 + k]) < need:
                out.append(name)
        return out


def must_wait_for_me(ctx: TransportContext, owner: str, version: int, words: np.ndarray) -> None:
    """A receiver refuses a version whose sender does not wait for it, before touching the
    model: the sender may overwrite a bucket while it loads, and it would serve nothing instead
    of the complete version it holds. The sender wrote whom it waits for (the participants
    fixed at its barrier, less those failed there) before publishing the first bucket; call
    this once that bucket is seen."""
    if ctx.control is None or int(words[ROSTER]) != version + 1:
        return  # no coordinator: the sender waits for every attached receiver
    roster = words[ROSTER + 2: ROSTER + 2 + int(words[ROSTER + 1])]
    if not (roster == np.uint64(owner_word(ctx.name))).any():
        raise VersionError(f"{owner}: receiver '{ctx.name}' is not a participant of version {version}: it registered "
                           f"(or came back) after the sender reached the barrier, so the sender does not wait for "
                           f"it; it joins the next version")
