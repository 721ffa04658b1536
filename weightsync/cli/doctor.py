"""Internal. ``weightsync doctor``: what this machine is, which transports can run on it and which vLLM
weight-transfer engines and verl entry points it has (:mod:`weightsync.cli.doctor_entry`), in a
form a person can paste into a bug report (or ``--json`` for tools).

Run it on every node type of a job (trainer and rollout): placement decides the transport,
but each side's drivers and packages decide what is possible.
"""

from __future__ import annotations

import json
import os
import platform as _platform
import sys

from ..transports.ipc import support as caps
from ..transports.ipc.support import Capability
from .doctor_entry import Report, format_entry_points, verl_entry_points, vllm_engines

_PACKAGES = {  # label -> distribution names to try
    "weightsync": ("weightsync",),
    "torch": ("torch",),
    "torch_npu": ("torch_npu", "torch-npu"),
    "ray": ("ray",),
    "vllm": ("vllm",),
    "vllm-ascend": ("vllm_ascend", "vllm-ascend"),
    "verl": ("verl",),
    "numpy": ("numpy",),
    "msgpack": ("msgpack",),
}
_ENV = ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ASCEND_TOOLKIT_HOME", "VLLM_ASCEND_ENABLE_NZ",
        "HCCL_BUFFSIZE", caps.DISABLE_IPC_VAR)


def add_doctor_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--shm-dir", default="/dev/shm", help="where segment files would live (default /dev/shm)")
    parser.add_argument("--shm-backing", default=None, choices=("auto", "memfd", "files"),
                        help="the shm_backing to report on (default: WEIGHTSYNC_SHM_BACKING, else auto)")


def _nvidia_driver() -> str | None:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            for word in fh.readline().split():
                if caps.parse_version(word) is not None and word[0].isdigit():
                    return word
    except OSError:
        pass
    return None


def _shm(shm_dir: str) -> Report:
    try:
        st = os.statvfs(shm_dir)
    except OSError as exc:
        return {"dir": shm_dir, "error": str(exc)}
    return {"dir": shm_dir, "total_mib": round(st.f_blocks * st.f_frsize / 2**20),
            "free_mib": round(st.f_bavail * st.f_frsize / 2**20)}


def _segments(choice: str, shm_dir: str) -> Report:
    """Where shm / host-ipc segments would live with ``shm_backing=choice``, and why."""
    from ..transports.shm.transport import resolve_backing

    try:
        backing, why = resolve_backing(choice, shm_dir)
    except Exception as exc:  # an explicit memfd that cannot work here
        return {"requested": choice, "backing": None, "reason": str(exc)}
    return {"requested": choice, "backing": backing, "reason": why}


def _broadcast(kind: str, registered: bool) -> Capability:
    if not registered:
        return Capability(False, "the broadcast transport is not part of this weightsync installation")
    try:
        import torch.distributed as dist
    except Exception as exc:  # a torch build without distributed
        return Capability(False, f"torch.distributed unavailable: {exc}")
    if not dist.is_available():
        return Capability(False, "torch was built without torch.distributed")
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except Exception as exc:
            return Capability(False, f"hccl needs torch_npu: {exc}")
        return Capability(True, "backend hccl (construction: see broadcast_group); also across nodes")
    if kind == "cuda":
        if not dist.is_nccl_available():
            return Capability(False, "this torch build has no NCCL")
        return Capability(True, "backend nccl (construction: see broadcast_group); also across nodes")
    if not dist.is_gloo_available():
        return Capability(False, "this torch build has no gloo")
    return Capability(True, "backend gloo (host memory); also across nodes")


def _groups(kind: str) -> Report:
    """The broadcast group's constructions per backend, and the one this platform would use
    with the config's ``communicator`` (``WEIGHTSYNC_COMMUNICATOR``, default auto)."""
    from ..device import backend_for
    from ..transports.broadcast import communicators

    backend = backend_for(kind)
    requested = os.environ.get("WEIGHTSYNC_COMMUNICATOR", "auto")
    try:
        name, why = communicators.choose_communicator(requested, backend)
        used: Report = {"backend": backend, "communicator": name, "reason": why}
    except Exception as exc:  # an explicit choice that cannot work here, or nothing can
        used = {"backend": backend, "communicator": None, "reason": str(exc)}
    return {"used_here": used, "requested": requested,
            "constructions": {b: communicators.constructions(b) for b in ("hccl", "nccl", "gloo")}}


def collect(shm_dir: str = "/dev/shm", shm_backing: str | None = None) -> Report:
    """Everything the report shows, as plain data."""
    from .. import device, transports

    kind = device.platform()
    versions = {label: caps.package_version(*names) for label, names in _PACKAGES.items()}
    cann, cann_src = caps.cann_version()
    hdk, hdk_src = caps.driver_version()
    import torch

    versions.update({
        "python": _platform.python_version(),
        "cann": cann, "ascend_driver": hdk,
        "cuda_runtime": torch.version.cuda, "nvidia_driver": _nvidia_driver(),
    })
    registered = transports.names()
    shm_ok = caps.host_ipc_support(shm_dir)
    segments = _segments(shm_backing or os.environ.get("WEIGHTSYNC_SHM_BACKING", "auto"), shm_dir)
    where = "memfds" if segments["backing"] == "memfd" else f"files in {shm_dir}"
    transport_caps = {
        "shm": Capability(shm_ok.ok, (f"host shared memory ({where}); receivers must share the sender's node"
                                      if shm_ok.ok else shm_ok.reason)),
        "ipc": caps.ipc_support(kind, shm_dir),
        "broadcast": _broadcast(kind, "broadcast" in registered),
    }
    for name, cap in list(transport_caps.items()):
        if cap.ok and name not in registered:
            transport_caps[name] = Capability(False, f"transport '{name}' is not part of this installation")
    return {
        "platform": kind,
        "device_count": device.device_count(kind),
        "cpu_count": os.cpu_count(),
        "host": _platform.node(),
        "os": f"{_platform.system()} {_platform.release()} {_platform.machine()}",
        "versions": versions,
        "version_sources": {"cann": cann_src or None, "ascend_driver": hdk_src or None},
        "env": {k: os.environ[k] for k in _ENV if k in os.environ},
        "shm": _shm(shm_dir),
        "segments": segments,
        "transports": {n: {"available": c.ok, "reason": c.reason, **({"notes": list(c.notes)} if c.notes else {})}
                       for n, c in transport_caps.items()},
        "broadcast_group": _groups(kind),
        "vllm_weight_transfer": vllm_engines(),
        "verl_entry_points": verl_entry_points(),
        "receive_ahead": _receive_ahead(),
        "auto": ("auto picks ipc for receivers on the sender's device, shm (CPU) or broadcast (accelerators) "
                 "for receivers on other devices of the node, broadcast across nodes"),
    }


def _receive_ahead() -> Report:
    """The receive_ahead setting from the environment and what an ahead copy may take on this node."""
    from ..config import SyncConfig
    from ..errors import ConfigError
    from ..transports.broadcast.ahead import bound

    try:
        cfg = SyncConfig.from_env()
    except ConfigError as exc:
        return {"setting": None, "error": str(exc)}
    limit, source = bound(cfg)
    return {"setting": cfg.receive_ahead, "copy_limit_mib": round(limit / 2**20), "source": source}


def format_report(r: Report) -> str:
    lines = ["weightsync doctor", "",
             f"platform:      {r['platform']} ({r['device_count']} device(s), {r['cpu_count']} CPU cores)",
             f"host:          {r['host']} / {r['os']}"]
    shm = r["shm"]
    lines.append(f"shm dir:       {shm['dir']} " + (f"({shm['free_mib']} MiB free of {shm['total_mib']} MiB)"
                                                   if "free_mib" in shm else f"(error: {shm.get('error')})"))
    seg = r["segments"]
    lines.append(f"segments:      {seg['backing'] or '-'} (shm_backing={seg['requested']}): {seg['reason']}")
    lines += ["", "versions:"]
    for k, v in r["versions"].items():
        src = r["version_sources"].get(k)
        lines.append(f"  {k:<14} {v or '-'}" + (f"   ({src})" if v and src else ""))
    if r["env"]:
        lines += ["", "environment:"] + [f"  {k}={v}" for k, v in r["env"].items()]
    lines += ["", "transports:"]
    for name, t in r["transports"].items():
        lines.append(f"  {name:<10} {'yes' if t['available'] else 'no '}  {t['reason']}")
        lines += [f"             note: {n}" for n in t.get("notes", ())]
    g = r["broadcast_group"]
    used = g["used_here"]
    lines += ["", f"broadcast group: backend {used['backend']}, communicator {used['communicator'] or '-'}: "
                  f"{used['reason']}"]
    for backend, options in g["constructions"].items():
        for name, c in options.items():
            lines.append(f"  {backend:<5} {name:<10} {'yes' if c['available'] else 'no '}  "
                         + (c["what"] if c["available"] else f"{c['what']}; {c['reason']}"))
    ahead = r["receive_ahead"]
    lines += ["", f"receive_ahead: {ahead['setting']} (environment); a receiver's ahead copy (one copy of the payload) "
                  f"may take up to {ahead['copy_limit_mib']} MiB here ({ahead['source']})"
              if "error" not in ahead else f"receive_ahead: {ahead['error']}"]
    lines += format_entry_points(r["vllm_weight_transfer"], r["verl_entry_points"])
    lines += ["", r["auto"]]
    return "\n".join(lines)


def run_doctor(args) -> int:
    report = collect(getattr(args, "shm_dir", "/dev/shm"), getattr(args, "shm_backing", None))
    if getattr(args, "json", False):
        json.dump(report, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return 0
