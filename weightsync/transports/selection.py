"""Internal. The transport choice: which transport a session uses, building it by name, and what this
machine can run.

**The choice** is a pure function of the config and where parties run. Each party is described
by a ``records.Placement``: ``node_id`` (its Ray node id), ``host`` (node address), ``device``
(type, index, physical), and for the sender ``ipc`` (can this process share device buckets by
handle: :func:`ipc_support`, a :class:`Capability`).
Two parties share a node (its /dev/shm, its devices) when their Ray node ids are equal; the
host address decides only where a party has no node id (no Ray): several raylets on one
machine, or nodes behind one address, are distinct nodes with distinct /dev/shm views.

The chain for ``auto``, best first:
  every receiver on the sender's device (same host, same physical accelerator)
      -> ipc  when the sender's platform supports it, else shm
  every receiver on the sender's node, weights in host memory (CPU)
      -> shm
  every receiver on the sender's node, on other devices
      -> broadcast over the device collective (hccl / nccl); shm on CPU-only nodes
  any receiver on another node
      -> broadcast, to every receiver (shm within the sender's node beside a broadcast
         across nodes is not built: receivers on the sender's node join the broadcast)

**Building it by name**: :func:`sender_class` / :func:`receiver_class` import the module the
transport table names (``weightsync.config``, where plugins add theirs) on first use, so a
transport's optional dependencies (torch_npu, ...) are needed only when it is chosen.

**What this machine can run** (the sender's ``ipc`` above, and ``weightsync doctor``):
platform facts, component versions, and per-transport verdicts with the reason behind each.
Version facts are read from files and package metadata, never by importing heavy stacks where
a file says the same (vLLM and vllm-ascend are looked up by metadata only). The verdict
functions are pure: they take the facts as arguments, so every rule is testable on a machine
without the hardware.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import platform as _platform
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..records import Device, IpcSupport, Placement

if TYPE_CHECKING:  # the interface's module imports torch, which the doctor's facts need not
    from .base import ReceiverTransport, SenderTransport, TransportContext

from . import catalog
from .catalog import COLOCATED, REMOTE, SAME_NODE


def is_accelerator(kind: str) -> bool:
    """Whether ``kind`` is a device with memory of its own (not the host): anything but the CPU,
    which a Placement names as "cpu"."""
    return kind != "cpu"


HOST = Device(type="cpu")


def node_key(party: Placement) -> str | None:
    """What identifies a party's node: its Ray node id, else (no Ray) its host address."""
    return party.node_id or party.host


def on_one_node(a: Placement, b: Placement) -> bool:
    if a.node_id and b.node_id:
        return a.node_id == b.node_id
    return a.host == b.host


def node_label(party: Placement) -> str:
    """A node as people read it: address and short Ray node id (simulated nodes share an address)."""
    node = party.node_id
    return f"{party.host} (node {node[:8]})" if node else str(party.host)


def placement(sender: Placement, receiver: Placement) -> str:
    """Where ``receiver`` runs relative to ``sender``: COLOCATED, SAME_NODE or REMOTE."""
    if not on_one_node(sender, receiver):
        return REMOTE
    sd, rd = sender.device or HOST, receiver.device or HOST
    kind = sd.type
    if kind != rd.type:
        return SAME_NODE
    if not is_accelerator(kind):
        return COLOCATED  # host memory: one node is one "device"
    mine, theirs = sd.physical, rd.physical
    return COLOCATED if mine is not None and mine == theirs else SAME_NODE


def _describe(receivers: Sequence[Placement], where: list[str], *kinds: str) -> str:
    names = [r.name or f"rank {r.rank}" for r, w in zip(receivers, where) if w in kinds]
    shown = ", ".join(str(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{len(names)} receiver(s) ({shown})"


def _far(receivers: Sequence[Placement], where: list[str]) -> str:
    return ", ".join(sorted({node_label(r) for r, w in zip(receivers, where) if w == REMOTE}))


def shared_device(sender: Placement, receivers: Sequence[Placement]) -> str | None:
    """Two parties on one physical accelerator, or None. A device collective (NCCL, HCCL)
    cannot hold one device twice: NCCL stops with "Duplicate GPU detected" or hangs."""
    seen: dict[tuple, str] = {}
    for who, party in [("the sender", sender)] + [(f"receiver '{r.name or r.rank}'", r) for r in receivers]:
        dev = party.device or HOST
        if not is_accelerator(dev.type) or dev.physical is None:
            continue
        key = (node_key(party), dev.type, dev.physical)
        if key in seen:
            return f"{seen[key]} and {who} share physical {dev.type} {dev.physical} on {node_label(party)}"
        seen[key] = who
    return None


def choose_transport(requested: str, sender: Placement, receivers: Sequence[Placement],
                     backend: str = "auto") -> tuple[str, str]:
    """Return (transport, reason). An explicit choice that cannot work raises ConfigError with the
    reason its folder gives; ``auto`` takes the transport whose rule ranks first for this
    placement (transports/catalog.py: each folder declares its rules) and says why.
    ``backend`` is the broadcast backend of the config (gloo may share a device)."""
    where = [placement(sender, r) for r in receivers]
    device = (sender.device or HOST).type
    facts = catalog.Facts(
        sender=sender, receivers=receivers, where=where, device=device,
        on_device=f"physical {device} {(sender.device or HOST).physical}" if is_accelerator(device) else "host",
        node=node_label(sender), ipc=sender.ipc or IpcSupport(ok=False, reason="the sender did not report ipc support"),
        clash=shared_device(sender, receivers) if backend != "gloo" else None,
        describe=lambda *kinds: _describe(receivers, where, *kinds), far=lambda: _far(receivers, where))
    if requested != "auto":
        why = catalog.get(requested).refuses(facts)
        if why:
            raise ConfigError(why)
        return requested, f"transport '{requested}' requested by config"
    ranked = catalog.ranked(facts)
    if not ranked:
        raise ConfigError(f"auto: no transport serves this placement ({', '.join(where) or 'no receivers'})")
    return ranked[0][1], ranked[0][2]


def sender_class(name: str) -> Callable[[TransportContext], SenderTransport]:
    """What builds the sender of transport ``name`` from a TransportContext (a class or a factory)."""
    t = catalog.get(name)
    return getattr(importlib.import_module(t.module), t.sender)


def receiver_class(name: str) -> Callable[[TransportContext, Mapping[str, Any]], ReceiverTransport]:
    """What builds the receiver of ``name`` from a TransportContext and the wire form of the
    sender's session record (parsed there: transports/base.py)."""
    t = catalog.get(name)
    return getattr(importlib.import_module(t.module), t.receiver)


# -- what this machine can run ------------------------------------------------------------------

ASCEND_ROOT = "/usr/local/Ascend"
# minimums for NPU device IPC (memory sharing between processes on one chip)
MIN_HDK = "25.3.RC1"
MIN_CANN = "8.3.RC1"
MIN_EXTENSION = "7.2.0"
# Ascend Extension for PyTorch 7.2.0 (CANN 8.3.RC1) shipped as these torch_npu releases, one
# per PyTorch line; a line newer than the table was released after 7.2.0 and qualifies
_EXTENSION_72 = {(2, 1): "2.1.0.post17", (2, 6): "2.6.0.post3", (2, 7): "2.7.1", (2, 8): "2.8.0"}
_NEWER_THAN_TABLE = (2, 9)
# operators set this to keep auto away from ipc on a host (a driver bug, a sandbox without
# shared device memory); the value is shown as the reason
DISABLE_IPC_VAR = "WEIGHTSYNC_DISABLE_IPC"


@dataclasses.dataclass(frozen=True)
class Capability:
    ok: bool
    reason: str
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "reason": self.reason}
        if self.notes:
            out["notes"] = list(self.notes)
        return out


# -- versions ------------------------------------------------------------------------------

_TAGS = {"dev": -4, "alpha": -3, "a": -3, "beta": -2, "b": -2, "t": -2, "rc": -1, "post": 0}


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """Ascend- and pip-style versions as comparable tuples: '8.3.RC1' < '8.3.0' < '8.3.1';
    '25.3.rc1' == '25.3.RC1'; '8.2.RC1.alpha003' < '8.2.RC1'; '2.7.1' < '2.7.1.post2'.
    None for text that is not a version."""
    if not text:
        return None
    pairs: list[tuple[int, int]] = []
    for i, token in enumerate(re.split(r"[.\-+_]", text.strip().lower())):
        m = re.fullmatch(r"(\d*)([a-z]*)(\d*)", token)
        if m is None or not token or (m.group(2) and m.group(2) not in _TAGS) or (m.group(3) and not m.group(2)):
            if i < 2:
                return None
            break  # trailing build tags and hashes do not order releases
        if m.group(1):
            pairs.append((int(m.group(1)), 0))
        if m.group(2):
            # a tag sorts below the plain number at its place: 8.3.RC1 < 8.3.0; post above it
            tag = _TAGS[m.group(2)]
            pairs.append((tag, int(m.group(3) or 0) + (1 if tag == 0 else 0)))
    if len(pairs) < 2:
        return None
    pairs += [(0, 0)] * (6 - len(pairs))
    return tuple(x for pair in pairs for x in pair)


def at_least(found: str | None, need: str) -> bool:
    f, n = parse_version(found), parse_version(need)
    return f is not None and n is not None and f >= n


def read_key(path: str, key: str) -> str | None:
    """Value of ``key=value`` in a small info file (case-insensitive key), or None."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                k, sep, v = line.partition("=")
                if sep and k.strip().lower() == key.lower():
                    return v.strip().strip("[]\"'") or None
    except OSError:
        return None
    return None


def package_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def driver_version(root: str = ASCEND_ROOT, etc: str = "/etc/ascend_install.info") -> tuple[str | None, str]:
    """(Ascend driver = HDK version, where it was read). The installer records the driver
    path in /etc/ascend_install.info; containers usually bind-mount the version file only."""
    dirs = []
    custom = read_key(etc, "Driver_Install_Path_Param")
    if custom:
        dirs.append(os.path.join(custom, "driver"))
    dirs.append(os.path.join(root, "driver"))
    for d in dirs:
        path = os.path.join(d, "version.info")
        v = read_key(path, "Version")
        if v:
            return v, path
    v = _npu_smi_version()
    return (v, "npu-smi") if v else (None, "")


def _npu_smi_version() -> str | None:
    exe = shutil.which("npu-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"Version:\s*([0-9][0-9A-Za-z.]*)", out)
    return m.group(1) if m else None


def cann_version(environ: Mapping[str, str] | None = None, root: str = ASCEND_ROOT,
                 arch: str | None = None) -> tuple[str | None, str]:
    """(CANN toolkit version, where it was read). set_env.sh exports ASCEND_TOOLKIT_HOME /
    ASCEND_HOME_PATH; default installs are ascend-toolkit/latest (CANN <= 8.3) or cann/
    (8.5+); each keeps <arch>-linux/ascend_toolkit_install.info with a 'version=' line."""
    env = os.environ if environ is None else environ
    arch = arch or _platform.machine()
    homes = [env.get("ASCEND_TOOLKIT_HOME"), env.get("ASCEND_HOME_PATH"),
             os.path.join(root, "ascend-toolkit", "latest"), os.path.join(root, "cann")]
    for home in homes:
        if not home:
            continue
        for path in (os.path.join(home, f"{arch}-linux", "ascend_toolkit_install.info"),
                     os.path.join(home, "ascend_toolkit_install.info")):
            v = read_key(path, "version")
            if v:
                return v, path
    return None, ""


def torch_npu_meets_extension(version: str | None) -> Capability:
    """Whether a torch_npu release belongs to Ascend Extension for PyTorch 7.2.0 or newer."""
    v = parse_version(version)
    if v is None:
        return Capability(False, "torch_npu is not installed")
    line = (v[0], v[2])  # (major, minor)
    if line >= _NEWER_THAN_TABLE:
        return Capability(True, f"torch_npu {version}")
    need = _EXTENSION_72.get(line)
    if need is None or not at_least(version, need):
        wanted = ", ".join(f"{n}+" for n in _EXTENSION_72.values())
        return Capability(False, f"torch_npu {version} predates Ascend Extension for PyTorch {MIN_EXTENSION} "
                                 f"(needs {wanted}, or any 2.9+)")
    return Capability(True, f"torch_npu {version}")


# -- verdicts (pure) -----------------------------------------------------------------------

def npu_ipc_support(hdk: str | None, cann: str | None, torch_npu: str | None,
                    nz: str | None = None) -> Capability:
    """NPU IPC needs HDK >= 25.3.RC1, CANN >= 8.3.RC1 and torch_npu of Extension >= 7.2.0."""
    if hdk is None:
        return Capability(False, f"Ascend driver (HDK) version unknown: no {ASCEND_ROOT}/driver/version.info "
                                 f"and no npu-smi (mount them into the container); NPU IPC needs HDK >= {MIN_HDK}")
    if not at_least(hdk, MIN_HDK):
        return Capability(False, f"Ascend HDK {hdk} is older than {MIN_HDK}, the first with NPU IPC")
    if cann is None:
        return Capability(False, f"CANN version unknown (no ascend_toolkit_install.info; source set_env.sh); "
                                 f"NPU IPC needs CANN >= {MIN_CANN}")
    if not at_least(cann, MIN_CANN):
        return Capability(False, f"CANN {cann} is older than {MIN_CANN}, the first with NPU IPC")
    ext = torch_npu_meets_extension(torch_npu)
    if not ext.ok:
        return Capability(False, ext.reason)
    notes = ()
    if nz not in (None, "0"):
        notes = (f"VLLM_ASCEND_ENABLE_NZ={nz}: vllm-ascend may cast weights to FRACTAL_NZ, which cannot be "
                 f"shared by handle; weightsync's buckets stay ND, but set VLLM_ASCEND_ENABLE_NZ=0 where "
                 f"engine weights themselves are shared",)
    return Capability(True, f"HDK {hdk}, CANN {cann}, {ext.reason}: NPU IPC supported", notes)


def cuda_ipc_support(available: bool, system: str) -> Capability:
    if not available:
        return Capability(False, "no CUDA device in this process")
    if system != "Linux":
        return Capability(False, f"CUDA IPC through torch needs Linux, this is {system}")
    return Capability(True, "CUDA IPC (cudaIpcMemHandle) through torch.multiprocessing.reductions")


def host_ipc_support(shm_dir: str) -> Capability:
    """CPU 'ipc' runs over shared host storage in ``shm_dir``."""
    if not os.path.isdir(shm_dir):
        return Capability(False, f"{shm_dir} does not exist: no shared host storage for the CPU ipc protocol")
    if not os.access(shm_dir, os.W_OK | os.X_OK):
        return Capability(False, f"{shm_dir} is not writable by this user")
    return Capability(True, f"buckets shared through host memory in {shm_dir} (the CPU form of device IPC)")


def ipc_support(device_type: str, shm_dir: str = "/dev/shm", environ: Mapping[str, str] | None = None) -> Capability:
    """Whether this process can share ipc buckets of ``device_type`` ('cpu', 'cuda', 'npu')."""
    env = os.environ if environ is None else environ
    disabled = env.get(DISABLE_IPC_VAR, "")
    if disabled not in ("", "0"):
        why = disabled if disabled not in ("1", "true", "yes") else "set by the operator"
        return Capability(False, f"{DISABLE_IPC_VAR}: {why}")
    if device_type == "cpu":
        return host_ipc_support(shm_dir)
    if device_type == "cuda":
        import torch

        return cuda_ipc_support(torch.cuda.is_available(), _platform.system())
    if device_type == "npu":
        hdk, _ = driver_version()
        cann, _ = cann_version(env)
        return npu_ipc_support(hdk, cann, package_version("torch_npu", "torch-npu"), env.get("VLLM_ASCEND_ENABLE_NZ"))
    from .. import device as devices  # torch comes with it: only for an accelerator a plugin registered

    acc = devices.accelerator(device_type)
    if acc is not None:  # it says for itself
        return Capability(*acc.ipc())
    return Capability(False, f"no ipc for device type {device_type!r}")
