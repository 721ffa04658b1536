"""Internal. Hosts that share nothing, on one Linux machine: a cluster of network namespaces on a bridge.

Each host of a :class:`Cluster` is
  - a network namespace with its own address (``10.213.N.(i+1)``, a private /24 no interface of
    the machine uses) on a Linux bridge of its own, through a veth pair: the host's end is
    ``eth0`` inside it, the bridge's end ``ws<tag>p<i>`` outside;
  - a link rate set with ``tc ... tbf`` on BOTH ends of that pair (the host end's egress and the
    bridge end's egress), so both directions are limited; ``netem`` is not used (no delay);
  - a mount namespace with a tmpfs of its own on ``/dev/shm`` and on ``/tmp``: no segment, file
    or socket of one host is seen by another, nor by the machine;
  - with ``ray=True``, a Ray node started inside it: the head on host 0, a raylet on each other
    host, each with the custom resource ``host<i>`` (``{"host1": 1}`` places an actor on host 1).

An *anchor* process (``sleep infinity``) holds each host's mount namespace; every other process
of the host (its Ray node, a job driver: ``run()``) enters the anchor's network and mount
namespaces with ``nsenter``. Nothing inside a host can reach outside it but the other hosts:
the namespaces have no default route and the bridge has no address.

Ray: token auth on for every process of the cluster (``RAY_AUTH_MODE=token`` and a fresh
``RAY_AUTH_TOKEN`` of this cluster's own), and Ray's temp dir is ``/tmp/r`` inside each host,
on the host's own tmpfs: the "current cluster" record of ``ray start --head`` is never seen by a
``ray.init()`` elsewhere on the machine, and it goes with the host.

Teardown (``close()``, idempotent, safe after a construction that failed half-way) goes by pid:
every process of the hosts' namespaces (``ip netns pids``) and every process this module
started is killed and waited for; then the namespaces, links and the bridge are deleted.
``leftovers()`` says what of the cluster still exists (empty after ``close()``).

Needs root and ``ip`` / ``tc`` / ``unshare`` / ``nsenter``: :func:`available` says whether this
machine can, and why not. No pytest here: the benchmark uses this module too.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

TOOLS = ("ip", "tc", "unshare", "nsenter")
RAY_PORT = 6379
RAY_TMP = "/tmp/r"  # inside each host, on its own tmpfs (short: Unix socket names are limited)
_seq = itertools.count()


def _sh(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def available() -> tuple[bool, str]:
    """(True, "") where this machine can build a :class:`Cluster`, else (False, why not)."""
    if not sys.platform.startswith("linux"):
        return False, "needs Linux network namespaces"
    if os.geteuid() != 0:
        return False, "needs root (network and mount namespaces, links, tc)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return False, f"needs {', '.join(missing)} on PATH (iproute2, util-linux)"
    probe = f"wsprobe{os.getpid() % 100000}"
    try:
        _sh("ip", "netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot create a network namespace: {exc}"
    try:
        _sh("ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit",
            "burst", "64kb", "latency", "50ms")
        _sh("ip", "netns", "exec", probe, "unshare", "--mount", "--propagation", "private", "sh", "-c",
            "mount -t tmpfs wsprobe /dev/shm")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"a namespace cannot have a tbf link or a tmpfs of its own: {exc}"
    finally:
        _sh("ip", "netns", "del", probe, check=False)
    return True, ""


def _check_rate(gbit: float | None) -> None:
    if gbit is not None and not gbit > 0:
        raise ValueError(f"a link rate is a positive number of Gbit/s (or None: no limit), not {gbit!r}")


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _sh("ip", "-4", "-o", "addr", "show").stdout + _sh("ip", "-4", "route", "show").stdout
    nets = []
    for word in out.split():
        try:
            nets.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    return nets


def _started_at(pid: int) -> int | None:
    """The start time (clock ticks since boot) of a live process ``pid``; None if gone or a zombie.
    With the pid, it names one process: a pid used again later is another process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


class Cluster:
    """``hosts`` isolated hosts on one bridge, each link limited to ``link_gbit`` Gbit/s both
    ways (None: no limit), with a Ray node on each (``ray=False``: namespaces only).

    ``shm_mb`` / ``tmp_mb``: the size of each host's /dev/shm and /tmp; ``object_store_mb`` and
    ``num_cpus``: each Ray node's; ``python``: the interpreter whose ``ray`` starts the nodes
    (this one by default); ``env``: more environment for every process of the cluster (e.g.
    PYTHONPATH). Built when the constructor returns; a failure tears down what was built."""

    def __init__(self, hosts: int = 3, link_gbit: float | None = 2.0, *, ray: bool = True, shm_mb: int = 512,
                 tmp_mb: int = 512, object_store_mb: int = 128, num_cpus: int = 2, python: str = sys.executable,
                 env: Mapping[str, str] | None = None, start_timeout_s: float = 120.0):
        if hosts < 1:
            raise ValueError("a cluster needs at least one host")
        _check_rate(link_gbit)
        self.hosts, self.python = hosts, python
        self.link_gbit: list[float | None] = [link_gbit] * hosts
        self.tag = self._free_tag()
        self.bridge = f"wsb{self.tag}"
        self.netns = [f"ws{self.tag}h{i}" for i in range(hosts)]
        self.ports = [f"ws{self.tag}p{i}" for i in range(hosts)]  # the bridge's end of each host's link
        self.network = self._free_network()
        self.addresses = [str(self.network.network_address + i + 1) for i in range(hosts)]
        self.ray_address = f"{self.addresses[0]}:{RAY_PORT}" if ray else None
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
            "LANG": os.environ.get("LANG", "C.UTF-8"), "RAY_TMPDIR": RAY_TMP,
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0",
            **(env or {})}
        self._anchors: list[subprocess.Popen | None] = [None] * hosts
        self._started: list[subprocess.Popen] = []  # every process this cluster started, anchors included
        self._made_ns: list[str] = []
        self._made_links: list[str] = []
        self._seen: dict[int, int] = {}  # pid -> start time of every process seen in a host
        self._closed = False
        try:
            self._build(shm_mb, tmp_mb)
            if ray:
                self._start_ray(object_store_mb, num_cpus, start_timeout_s)
        except BaseException:
            self.close()
            raise

    # -- construction ----------------------------------------------------------------

    @staticmethod
    def _free_tag() -> str:
        links = set(os.listdir("/sys/class/net"))
        spaces = set(_sh("ip", "netns", "list").stdout.split())
        for _ in range(256):
            tag = f"{(os.getpid() * 31 + next(_seq) * 7919) & 0xFFFF:04x}"
            if f"wsb{tag}" not in links and not any(s.startswith(f"ws{tag}h") for s in spaces):
                return tag
        raise RuntimeError("no free name for a cluster's bridge")

    def _free_network(self) -> ipaddress.IPv4Network:
        used = _used_networks()
        start = int(self.tag, 16) % 200
        for k in range(200):
            net = ipaddress.ip_network(f"10.213.{16 + (start + k) % 200}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
        raise RuntimeError("every 10.213.N.0/24 is in use on this machine")

    def _build(self, shm_mb: int, tmp_mb: int) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_links.append(self.bridge)
        self._no_ipv6(self.bridge)  # no router solicitations and such: the links carry what the hosts send
        _sh("ip", "link", "set", self.bridge, "up")
        prefix = self.network.prefixlen
        for i, ns in enumerate(self.netns):
            _sh("ip", "netns", "add", ns)
            self._made_ns.append(ns)
            inner = f"ws{self.tag}h{i}"
            _sh("ip", "link", "add", inner, "type", "veth", "peer", "name", self.ports[i])
            self._made_links += [self.ports[i], inner]
            _sh("ip", "link", "set", inner, "netns", ns, "name", "eth0")
            self._no_ipv6(self.ports[i])
            _sh("ip", "link", "set", self.ports[i], "master", self.bridge)
            _sh("ip", "link", "set", self.ports[i], "up")
            ex = ("ip", "netns", "exec", ns)
            _sh(*ex, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
            _sh(*ex, "ip", "link", "set", "lo", "up")
            _sh(*ex, "ip", "addr", "add", f"{self.addresses[i]}/{prefix}", "dev", "eth0")
            _sh(*ex, "ip", "link", "set", "eth0", "up")
            self._set_qdiscs(i)
            # the anchor: holds the host's mount namespace (own tmpfs on /dev/shm and /tmp)
            script = (f"mount -t tmpfs -o size={shm_mb}m,mode=1777 ws{self.tag}shm /dev/shm && "
                      f"mount -t tmpfs -o size={tmp_mb}m,mode=1777 ws{self.tag}tmp /tmp && "
                      f"mkdir -p {RAY_TMP} && echo up && exec sleep infinity")
            anchor = subprocess.Popen([*ex, "unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                      text=True, start_new_session=True)
            self._started.append(anchor)
            self._remember([anchor.pid])
            self._anchors[i] = anchor
            line = anchor.stdout.readline().strip()
            if line != "up":
                raise RuntimeError(f"host {i} did not come up: {line} {anchor.stderr.read()[-2000:]}")

    @staticmethod
    def _no_ipv6(link: str) -> None:
        path = f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6"
        if os.path.exists(path):
            with open(path, "w") as f:
                f.write("1")

    def _set_qdiscs(self, host: int) -> None:
        gbit = self.link_gbit[host]
        for where in (("ip", "netns", "exec", self.netns[host], "tc"), ("tc",)):
            dev = "eth0" if len(where) > 1 else self.ports[host]
            if gbit is None:
                _sh(*where, "qdisc", "del", "dev", dev, "root", check=False)
                continue
            rate = int(gbit * 1e9)
            # a burst of ~4 ms of the rate (at least 64 KiB, the largest segment veth hands tbf):
            # a small part of any payload worth timing, large enough for the kernel's timers
            burst = max(64 * 1024, rate // 8 // 250)
            _sh(*where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate}bit", "burst", str(burst),
                "latency", "100ms")

    def _start_ray(self, object_store_mb: int, num_cpus: int, timeout: float) -> None:
        ray_bin = os.path.join(os.path.dirname(self.python), "ray")
        common = ["--num-cpus", str(num_cpus), "--object-store-memory", str(object_store_mb * 2**20),
                  "--disable-usage-stats", "--block"]
        for i in range(self.hosts):
            where = ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"] if i == 0 else \
                ["--address", self.ray_address]
            self.run(i, [ray_bin, "start", *where, "--node-ip-address", self.addresses[i],
                         "--resources", f'{{"host{i}": 8}}', *common],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if i == 0:
                self._wait_port(0, RAY_PORT, timeout)
        self.wait_nodes(self.hosts, timeout)

    def _wait_port(self, host: int, port: int, timeout: float) -> None:
        probe = ("import socket,sys,time\nend=time.time()+float(sys.argv[3])\nwhile True:\n"
                 " try:\n  socket.create_connection((sys.argv[1],int(sys.argv[2])),1).close();break\n"
                 " except OSError:\n  time.sleep(0.2)\n  assert time.time()<end,'no answer'\n")
        proc = self.run(host, [self.python, "-c", probe, self.addresses[host], str(port), str(timeout)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, err = proc.communicate(timeout=timeout + 10)
        if proc.returncode != 0:
            raise RuntimeError(f"host {host}: nothing listens on port {port} after {timeout:.0f} s: {err[-1500:]}")

    def wait_nodes(self, count: int, timeout: float = 120.0) -> None:
        """Until ``count`` Ray nodes are alive (asked from host 0)."""
        probe = ("import sys,time,ray\nray.init(address=sys.argv[1],logging_level='ERROR',log_to_driver=False)\n"
                 "end=time.time()+float(sys.argv[3])\n"
                 "while sum(n['Alive'] for n in ray.nodes())<int(sys.argv[2]):\n"
                 " assert time.time()<end,'nodes: %s'%[(n['NodeManagerAddress'],n['Alive']) for n in ray.nodes()]\n"
                 " time.sleep(0.3)\n")
        proc = self.run(0, [self.python, "-c", probe, self.ray_address, str(count), str(timeout)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            _, err = proc.communicate(timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"{count} Ray nodes did not come up: {err[-2000:]}")

    # -- using the hosts -------------------------------------------------------------

    def address(self, host: int) -> str:
        return self.addresses[host]

    def run(self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
            cwd: str | None = None, **popen: object) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (its network and mount namespaces), with the cluster's
        environment, ``WS_HOST`` (the host's index), ``WS_HOST_ADDRESS`` and ``WS_RAY_ADDRESS``
        under ``env``. Its own session (process group); the cluster kills it at close() if it
        still runs. ``popen``: Popen's other arguments (stdout=, stdin=, text=, ...)."""
        anchor = self._anchors[host]
        if anchor is None or anchor.poll() is not None:
            raise RuntimeError(f"host {host} is down")
        full = {**self.env, "WS_HOST": str(host), "WS_HOST_ADDRESS": self.addresses[host],
                **({"WS_RAY_ADDRESS": self.ray_address} if self.ray_address else {}), **(env or {})}
        cwd = cwd or os.getcwd()
        proc = subprocess.Popen(["nsenter", "--target", str(anchor.pid), "--net", "--mount", f"--wd={cwd}", "--",
                                 *argv], env=full, start_new_session=True, **popen)
        self._started.append(proc)
        self._remember([proc.pid])
        return proc

    def pids(self, host: int) -> list[int]:
        """Every process inside ``host`` (its network namespace)."""
        out = _sh("ip", "netns", "pids", self.netns[host], check=False).stdout.split()
        pids = [int(p) for p in out if p.isdigit()]
        self._remember(pids)
        return pids

    def _remember(self, pids: Sequence[int]) -> None:
        for pid in pids:
            started = _started_at(pid)
            if started is not None:
                self._seen.setdefault(pid, started)

    def cut(self, host: int) -> None:
        """The host's link goes down (the bridge's end): nothing reaches it or leaves it, its
        processes live on."""
        _sh("ip", "link", "set", self.ports[host], "down")

    def restore(self, host: int) -> None:
        """The host's link comes back up, at the rate it had."""
        _sh("ip", "link", "set", self.ports[host], "up")

    def set_rate(self, host: int, gbit: float | None) -> None:
        """The host's link rate, both directions (None: no limit)."""
        _check_rate(gbit)
        self.link_gbit[host] = gbit
        self._set_qdiscs(host)

    def link_bytes(self, host: int) -> tuple[int, int]:
        """(bytes the host sent, bytes it received) over its link, from the kernel's counters
        of its veth (read at the bridge's end, whose rx is the host's tx)."""
        base = f"/sys/class/net/{self.ports[host]}/statistics"
        with open(f"{base}/rx_bytes") as rx, open(f"{base}/tx_bytes") as tx:
            return int(rx.read()), int(tx.read())

    def read(self, host: int, path: str) -> bytes | None:
        """The file ``path`` as the host sees it (its own /tmp, /dev/shm), or None where it has
        none: read from outside through its anchor's root, so it works while the host is cut off."""
        anchor = self._anchors[host]
        if anchor is None:
            return None
        try:
            with open(f"/proc/{anchor.pid}/root{path}", "rb") as f:
                return f.read()
        except OSError:
            return None

    def kill(self, host: int) -> list[int]:
        """Every process of ``host`` killed (SIGKILL), the anchor included: a lost host. Its
        namespace stays until close(). Returns the pids killed."""
        anchor = self._anchors[host]
        pids = self.pids(host)
        if anchor is not None:
            pids = sorted({*pids, anchor.pid})
        self._remember(pids)
        self._kill(pids)
        self._anchors[host] = None
        return pids

    # -- teardown --------------------------------------------------------------------

    def _kill(self, pids: Sequence[int], timeout: float = 15.0) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self._started:  # reap our children so none stays a zombie
            if proc.pid in pids:
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
        deadline = time.monotonic() + timeout
        while any(self._alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _alive(self, pid: int) -> bool:
        started = _started_at(pid)
        return started is not None and self._seen.get(pid, started) == started

    def close(self) -> None:
        """Kill every process of the hosts and every one started here, delete the namespaces,
        links and bridge. Idempotent."""
        if self._closed:
            return
        self._closed = True
        pids: set[int] = {p.pid for p in self._started if p.poll() is None}
        for i, ns in enumerate(self.netns):
            if ns in self._made_ns:
                pids.update(self.pids(i))
        self._remember(sorted(pids))
        self._kill(sorted(pids))
        for proc in self._started:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        self._anchors = [None] * self.hosts
        # the links first: deleting a veth's end takes its peer at once, while a namespace's
        # own links go some time after the namespace is deleted
        for link in self._made_links:
            if os.path.exists(f"/sys/class/net/{link}"):
                _sh("ip", "link", "del", link, check=False)
        for ns in self._made_ns:
            _sh("ip", "netns", "del", ns, check=False)

    def leftovers(self) -> list[str]:
        """What of this cluster still exists: namespaces, links, processes, mounts of its tmpfs."""
        left = [f"namespace {ns}" for ns in _sh("ip", "netns", "list").stdout.split() if ns in self.netns]
        left += [f"link {n}" for n in os.listdir("/sys/class/net") if n == self.bridge or n.startswith(f"ws{self.tag}")]
        left += [f"process {p}" for p in sorted(self._seen) if self._alive(p)]
        mark = f"ws{self.tag}"
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/mountinfo") as f:
                    if any(f" {mark}shm " in line or f" {mark}tmp " in line for line in f):
                        left.append(f"mount of {mark} held by process {pid}")
            except OSError:
                continue
        return left

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
