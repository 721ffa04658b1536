"""Internal. Will a benchmark size, or one row of it, fit in this node's memory? Estimates of what each
holds, so the bench skips what would not fit, with a message, instead of being OOM-killed
halfway through a run (Ray's memory monitor or the kernel's OOM killer).

A size holds, for all its rows, the trainer's copy of the model and one engine copy per
receiver. A row adds its transport's buffers: shm one whole-version segment per slot it
cycles through (``shm_max_segments``), or its ring of bucket buffers where whole versions
exceed the shm budget (transports/shm/transport.py: the transport decides the same way), ipc (on a host) two bucket files in /dev/shm, broadcast
two bucket buffers and a scratch bucket per party; the Ray baselines the object in the store
(and with torch tensors a deserialized copy per receiver and the trainer's pickle). Pure
functions: the caller passes what /proc/meminfo and statvfs said.
"""

from __future__ import annotations

import os

GiB = 2**30
# per process and row, beyond the buffers counted: transient copies and allocator slack. The
# bench measured receivers of ipc and broadcast rows at up to ~0.55 GiB over their 1.17 GiB
# model; half the payload, at most this, per party
PARTY_SLACK = GiB // 2


def reserve(total: int) -> int:
    """Memory left free on top of an estimate: the driver, Ray's own processes, page cache
    the kernel cannot drop at once, and the estimate's error."""
    return max(GiB, total // 20)


def models_bytes(payload: int, receivers: int) -> int:
    """The trainer's copy and one engine copy per receiver, resident for every row of a size."""
    return (1 + receivers) * payload


def row_bytes(name: str, payload: int, bucket_bytes: int, receivers: int, shm_segments: int,
              shm_need: int | None = None, first_use: bool = True) -> tuple[int, int]:
    """(node bytes, of which in the shm directory) that one row adds over the models.
    ``shm_need``: what shm holds in the mode its transport picks (shm.transport.choose_mode);
    None: ``shm_segments`` whole versions. ``first_use``: a row with actors of its own
    (ray-rdt-*) makes them now, so their models count too."""
    parties = receivers + 1
    slack = parties * min(PARTY_SLACK, payload // 2)
    if name in ("shm", "auto"):  # auto on one host picks shm
        shm = shm_segments * payload if shm_need is None else shm_need
        return shm + slack, shm
    if name == "ipc":
        return 2 * bucket_bytes + slack, 2 * bucket_bytes
    if name == "broadcast":
        return 3 * bucket_bytes * parties + slack, 0
    if name == "ray-numpy":
        return payload + slack, payload
    if name == "ray-user":
        return (2 + receivers) * payload + slack, payload
    if name.startswith("ray-rdt"):
        # each rollout's receive buffers (Ray allocates them, the load copies out of them); on
        # the row's first round also the pair's own trainer and engine copies (rdt_rows.RdtPair)
        return receivers * payload + (models_bytes(payload, receivers) if first_use else 0) + slack, 0
    return 0, 0  # the collective baselines check their own memory (baseline_rows)


def refusal(what: str, need: int, available: int, total: int, shm_need: int = 0,
            shm_free: int | None = None, detail: str = "") -> str | None:
    """Why ``what`` must be skipped, or None when ``need`` bytes fit in ``available``."""
    keep = reserve(total)
    if need + keep > available:
        return (f"skipped: {what} needs about {need / GiB:.1f} GiB{f' ({detail})' if detail else ''}, "
                f"{available / GiB:.1f} GiB available and {keep / GiB:.1f} GiB kept free")
    if shm_free is not None and shm_need > shm_free:
        return (f"skipped: {what} needs {shm_need / GiB:.1f} GiB in the shm directory, "
                f"{shm_free / GiB:.1f} GiB free there")
    return None


def shm_free(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def describe_row(name: str, payload: int, bucket_bytes: int, receivers: int, shm_segments: int,
                 shm_ring: int = 0) -> str:
    """What the estimate of a row counts, for the refusal message (``shm_ring``: buffers of
    shm's streaming mode, 0 for whole versions)."""
    gib = payload / GiB
    if name in ("shm", "auto"):
        if shm_ring:
            return (f"a ring of {shm_ring} x {bucket_bytes / 2**20:g} MiB bucket buffers (streaming: whole versions "
                    f"exceed the budget)")
        return f"{shm_segments} whole-version segments of {gib:.1f} GiB"
    if name == "ray-user":
        return f"the object of {gib:.1f} GiB, the pickle and one copy per receiver"
    if name == "ray-numpy":
        return f"the object of {gib:.1f} GiB in the store"
    if name.startswith("ray-rdt"):
        return f"{receivers} receive cop{'y' if receivers == 1 else 'ies'} of {gib:.1f} GiB (and its actors' models on first use)"
    return f"{bucket_bytes / 2**20:g} MiB buckets"


def keep_baselines(payload: int, receivers: int, groups: int, shm_segments: int, available: int | None = None,
                   total: int | None = None, store: bool = True) -> frozenset[str]:
    """Which baselines' own actors may stay for the whole run, saving their set-up each round
    (~15 s each on the 0.5B layout on the shared 2-core VM): "rdt" (RDT pairs, which then start
    beside the bench's actors) and "groups" (the ``groups`` collective baselines' groups). Only
    where the node holds them beside the bench's models and still twice what shm's whole
    versions need, so the shm rows keep their mode (shm.transport.choose_mode takes half of what
    the node can give and streams through a ring when whole versions do not fit: another mode,
    measured as shm). ``available`` / ``total``: the node's, now (default: psutil's). ``store``:
    the object store baselines run, whose pages stay resident in /dev/shm once written (about
    two versions' worth): on the shared VM, counting them is what kept shm out of its ring."""
    if available is None or total is None:
        import psutil

        vm = psutil.virtual_memory()
        available, total = vm.available, vm.total
    base = models_bytes(payload, receivers) + 2 * shm_segments * payload + reserve(total) + (2 * payload if store else 0)
    rdt = models_bytes(payload, receivers)  # the pair's trainer and engine copies
    # a flat broadcast group: the sender's buffer, per receiver a model and a buffer
    group = groups * (1 + 2 * receivers) * payload
    keep = set()
    if base + rdt <= available:
        keep.add("rdt")
        if base + rdt + group <= available:
            keep.add("groups")
    return frozenset(keep)
