"""Internal. Human-readable rendering of the coordinator's status()."""

from __future__ import annotations

from ..records import Status


def format_status(status: Status) -> str:
    lines = [
        f"weightsync session {status.session}: transport={status.transport} ({status.transport_reason})",
        f"  manifest: {status.manifest_tensors} tensors, {status.payload_bytes / 2**20:.1f} MiB; "
        f"latest committed version: {status.latest_committed}",
        "  parties:",
    ]
    for p in status.parties:
        state = "alive" if p.alive else "DOWN"
        extra = f" applying={p.applying}" if p.applying is not None else ""
        why = f" -- {p.why}" if p.why else ""
        extra += " ahead" if p.ahead else ""  # its ahead thread takes versions before the barrier
        served = f" serving={p.serving}{extra} manifest={p.manifest}" if p.role == "receiver" else ""
        lines.append(f"    {p.role:<8} {p.name:<16} rank={p.rank:<3} {state:<5}{served} "
                     f"silent={p.silent_s:.1f}s{why}")
    if status.versions:
        lines.append("  versions:")
    for v in status.versions:
        speed = f" {v.gbps:.2f} GB/s" if v.gbps else ""
        barrier = f" barrier={v.barrier_s * 1e3:.1f}ms" if v.barrier_s is not None else ""
        stage = v.phases_s.get("stage_s")
        stage_txt = f" stage={stage * 1e3:.1f}ms" if stage is not None else ""
        reason = f" reason: {v.reason}" if v.reason else ""
        digest = f" digest={v.digest}" if v.digest else ""
        odd = sorted(n for n, d in v.receiver_digests.items() if d and d != v.digest)
        digest += f" (differs on {', '.join(odd)})" if digest and odd else ""
        lines.append(f"    v{v.version:<6} {v.state:<12} slot={v.slot}{stage_txt}{barrier}{speed}{digest}{reason}")
    if status.resources:
        lines.append("  open resources: " + ", ".join(f"{k}={n}" for k, n in sorted(status.resources.items())))
    copies = status.resources.get("ahead_copy_bytes")
    if copies:  # receive_ahead: one copy of the payload per receiver that keeps one
        lines.append(f"  receive_ahead copies: {copies / 2**20:.1f} MiB in all")
    return "\n".join(lines)
