"""Internal. One config object for the whole service, loadable from a mapping or the environment.

Every field is validated on construction, so a bad value fails where it is written
(a YAML file, a Hydra override, an environment variable), not deep inside a transfer.

The choices a field accepts live here too, the transports' names among them.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

# built in; an accelerator registered with weightsync.device.register adds its kind, backend and
# the constructions of its collective group (docs/platforms.md)
BACKENDS = ("auto", "gloo", "nccl", "hccl")
COMMUNICATORS = ("auto", "torch", "torch_npu", "pyhccl", "pynccl")
DEVICES = ("auto", "cpu", "cuda", "npu")
DIGESTS = ("auto", "xxh3", "torch", "off")
SHM_BACKINGS = ("auto", "memfd", "files")
DELTAS = ("off", "auto", "on")
RECEIVE_AHEADS = ("off", "auto", "on")
CONTROL_CHANNELS = ("socket", "ray")
ENV_PREFIX = "WEIGHTSYNC_"
# WEIGHTSYNC_ variables that are not config fields, each read by the package itself; every other
# WEIGHTSYNC_ variable must name a field (typos fail loudly)
NON_CONFIG_ENV = frozenset({
    "WEIGHTSYNC_DIGEST_KERNEL", "WEIGHTSYNC_DISABLE_IPC", "WEIGHTSYNC_NOTIFY", "WEIGHTSYNC_RING_BUFFERS",
    "WEIGHTSYNC_DEVICE_MODULES",
})
MiB = 1 << 20

# the transports a config may name ("auto" besides): the built-in ones (weightsync.transports.BUILTIN;
# tests/test_config.py checks the two lists agree) and those a plugin registered in this process
# (weightsync.transports.register adds them here)
TRANSPORTS: list[str] = ["broadcast", "ipc", "relay", "shm"]


def transport_names() -> list[str]:
    """The transports a config may name ("auto" besides), sorted."""
    return sorted(TRANSPORTS)



@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """How weights move: one frozen, validated object for the whole job.

    Every field, its default and what it does: the Configuration page (``docs/configuration.md``).
    Build it with keywords, ``from_mapping()`` (a dict, a verl / Hydra block) or ``load()``
    (a mapping, then ``WEIGHTSYNC_<KEY>`` environment variables on top).

    Raises:
        ConfigError: A value is impossible (the message names the key): an unknown choice,
            a non-positive size or timeout, ``heartbeat_timeout_s`` not above
            ``heartbeat_interval_s``, ``align_bytes`` not a power of two >= 16, ...
    """

    # which transport moves bucket bytes; "auto" picks by placement (see README)
    transport: str = "auto"
    # collective backend of the broadcast transport; "auto" follows the device
    backend: str = "auto"
    # how the broadcast group is built: "auto" is pyhccl on NPU when vllm_ascend imports
    # (else torch_npu), torch on CUDA and CPU; pynccl on request (docs/platforms.md)
    communicator: str = "auto"
    # device the receivers load on; "auto" detects npu > cuda > cpu
    device: str = "auto"
    # bucket size; also the unit of checksums and pipelining. 16 MiB keeps a bucket in the
    # last-level cache between its checksum and its load on host paths (measured: README,
    # Benchmark); device links may prefer larger buckets
    bucket_mb: float = 16.0
    # byte alignment of every tensor inside a bucket (power of two, >= 16)
    align_bytes: int = 256
    # verify a per-bucket digest before any byte of the bucket is loaded; false = digest off
    checksum: bool = True
    # its kind: xxh3 on the host, torch ops on the bucket's device, "auto" (xxh3 for host
    # buckets, torch for device ones: NCCL/HCCL broadcast, device ipc), or off (docs/digest.md)
    digest: str = "auto"
    # keep the previous version's data until every receiver committed the new one,
    # so a receiver that fails part-way can roll back instead of going stale
    keep_previous: bool = True
    # a batch generated with version v may train step s only if s - v <= max_staleness
    max_staleness: int = 1
    # deadline for registration, rendezvous and manifest agreement
    connect_timeout_s: float = 120.0
    # deadline for one version, from the barrier to the last receiver's report
    sync_timeout_s: float = 300.0
    # parties ping the coordinator this often ...
    heartbeat_interval_s: float = 1.0
    # ... and a party silent for this long is reported as dead or stalled
    heartbeat_timeout_s: float = 10.0
    # Ray actor name (and namespace) of the coordinator; one per job
    coordinator_name: str = "weightsync"
    namespace: str = ""
    # how parties reach the coordinator: "socket", a TCP port of the coordinator's own (one Ray
    # call only to learn it, a restarted coordinator reached through Ray); "ray", every call an
    # actor call (no port beside Ray's: for nodes that reach each other on Ray's ports only)
    control_channel: str = "socket"
    # what backs shared-memory segments: memfd (freed by the kernel when the last holder
    # exits), files in shm_dir (outlive a dead job until reaped), auto = memfd where it works
    shm_backing: str = "auto"
    # where segment files live (files backing) and how many segments one session may hold at once
    shm_dir: str = "/dev/shm"
    shm_max_segments: int = 3
    # shared memory the shm transport may use on a node, in MiB; 0 = auto (half of what the
    # node can give: MemAvailable or the memory cgroup's room, and for files no more than
    # shm_dir's free space). Whole versions when
    # shm_max_segments of them fit, else streaming through a ring of bucket buffers (docs/design.md)
    shm_budget_mb: float = 0.0
    # address the broadcast rendezvous store binds to ("auto": this node's Ray address)
    rendezvous_host: str = "auto"
    rendezvous_port: int = 0
    # send per bucket only what changed since the last committed version (docs/delta.md):
    # "auto": the faster way as timed on this link (delta/policy.py), "on" always, "off" never
    delta: str = "off"
    # move a version's bytes to the receivers before the barrier, while the engine still serves
    # the one before (docs/one-step-off.md): broadcast sends at stage() into a host / device
    # shadow of one copy of the payload per receiver, which the barrier only loads; shm verifies
    # ahead in its segment. "on": every version it can (a receiver whose shadow does not fit
    # fails the session, named); "auto": where the shadow fits, else at the barrier; "off": never
    receive_ahead: str = "off"
    # the shadow's bound per receiver, in MiB; 0 = auto (half of what the node can give now)
    receive_ahead_max_mb: float = 0.0

    def __post_init__(self) -> None:
        _check_choice("transport", self.transport, ("auto", *transport_names()))
        _check_choice("backend", self.backend, BACKENDS, "backends")
        _check_choice("communicator", self.communicator, COMMUNICATORS, "constructions")
        _check_choice("device", self.device, DEVICES, "kinds")
        _check_choice("digest", self.digest, DIGESTS)
        _check_choice("shm_backing", self.shm_backing, SHM_BACKINGS)
        _check_choice("delta", self.delta, DELTAS)
        _check_choice("receive_ahead", self.receive_ahead, RECEIVE_AHEADS)
        _check_choice("control_channel", self.control_channel, CONTROL_CHANNELS)
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb!r}")
        a = self.align_bytes
        if a < 16 or a & (a - 1):
            raise ConfigError(f"align_bytes must be a power of two >= 16, got {a!r}")
        if self.bucket_bytes < a:
            raise ConfigError(
                f"bucket_mb={self.bucket_mb} gives a bucket of {self.bucket_bytes} bytes, "
                f"smaller than align_bytes={a}"
            )
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness!r}")
        for key in ("connect_timeout_s", "sync_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s"):
            value = getattr(self, key)
            if not value > 0:
                raise ConfigError(f"{key} must be a positive number of seconds, got {value!r}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        if self.shm_max_segments < 2:
            raise ConfigError(f"shm_max_segments must be >= 2, got {self.shm_max_segments!r}")
        if not self.shm_budget_mb >= 0:
            raise ConfigError(f"shm_budget_mb must be >= 0 (0: auto), got {self.shm_budget_mb!r}")
        if not self.receive_ahead_max_mb >= 0:
            raise ConfigError(f"receive_ahead_max_mb must be >= 0 (0: auto), got {self.receive_ahead_max_mb!r}")
        if not 0 <= self.rendezvous_port < 65536:
            raise ConfigError(f"rendezvous_port must be in 0..65535, got {self.rendezvous_port!r}")
        if not self.coordinator_name:
            raise ConfigError("coordinator_name must not be empty")

    @property
    def bucket_bytes(self) -> int:
        """Bucket size in bytes (``bucket_mb``), rounded down to the alignment."""
        raw = int(self.bucket_mb * MiB)
        return raw - raw % self.align_bytes

    # -- loading ---------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, mapping: Any, base: SyncConfig | None = None) -> SyncConfig:
        """Build from a dict or an OmegaConf-like mapping; unknown keys are errors.

        Args:
            mapping: Keys of this class with values (strings are converted, "true" / "1" for
                booleans); None gives ``base`` unchanged.
            base: The config the values go on top of; the defaults when None.

        Returns:
            The new config.

        Raises:
            ConfigError: ``mapping`` is not a mapping, a key is unknown (the closest known key
                is suggested), or a value has the wrong type or is impossible.
        """
        if mapping is None:
            return base or cls()
        if not isinstance(mapping, Mapping) and not hasattr(mapping, "keys"):
            raise ConfigError(f"weightsync config must be a mapping, got {type(mapping).__name__}")
        fields = _fields()
        values: dict[str, Any] = {}
        for key in mapping.keys():
            key = str(key)
            if key not in fields:
                raise ConfigError(_unknown_key(key, fields))
            values[key] = _coerce(key, mapping[key], fields[key])
        return dataclasses.replace(base or cls(), **values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, base: SyncConfig | None = None) -> SyncConfig:
        """Apply ``WEIGHTSYNC_<FIELD>`` variables on top of ``base``; unknown ones are errors.

        Args:
            environ: The variables; ``os.environ`` when None. ``WEIGHTSYNC_`` variables the
                package reads elsewhere (``WEIGHTSYNC_DISABLE_IPC``, ``WEIGHTSYNC_NOTIFY``, ...)
                are not config keys and are skipped.
            base: The config the values go on top of; the defaults when None.

        Returns:
            The new config.

        Raises:
            ConfigError: A ``WEIGHTSYNC_`` variable names no key, or its value is wrong.
        """
        environ = os.environ if environ is None else environ
        fields = _fields()
        values: dict[str, Any] = {}
        for name, raw in environ.items():
            if not name.startswith(ENV_PREFIX) or name in NON_CONFIG_ENV:
                continue
            key = name[len(ENV_PREFIX):].lower()
            if key not in fields:
                raise ConfigError(_unknown_key(key, fields, env_name=name))
            values[key] = _coerce(key, raw, fields[key], env_name=name)
        return dataclasses.replace(base or cls(), **values)

    @classmethod
    def load(cls, mapping: Any = None, environ: Mapping[str, str] | None = None) -> SyncConfig:
        """Mapping first, then the environment on top (env wins, as for a one-off override).

        Args:
            mapping: As for ``from_mapping()``.
            environ: As for ``from_env()``.

        Returns:
            The new config.

        Raises:
            ConfigError: As ``from_mapping()`` and ``from_env()`` raise it.
        """
        return cls.from_env(environ, base=cls.from_mapping(mapping))

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value.

        Returns:
            A plain dict that ``from_mapping()`` turns back into this config.
        """
        return dataclasses.asdict(self)


def _fields() -> dict[str, type]:
    hints = {"str": str, "float": float, "int": int, "bool": bool}
    return {f.name: hints[f.type] for f in dataclasses.fields(SyncConfig)}


def _unknown_key(key: str, fields: Mapping[str, type], env_name: str | None = None) -> str:
    where = f"environment variable {env_name}" if env_name else f"key '{key}'"
    close = difflib.get_close_matches(key, list(fields), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown weightsync config {where}{hint}; known keys: {', '.join(sorted(fields))}"


def _coerce(key: str, value: Any, kind: type, env_name: str | None = None) -> Any:
    where = env_name or key
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} must be a boolean, got {value!r}")
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    try:
        number = float(value) if kind is float else int(str(value).strip()) if isinstance(value, str) else value
    except ValueError:
        raise ConfigError(f"{where} must be {'a number' if kind is float else 'an integer'}, got {value!r}") from None
    if kind is int and (not isinstance(number, int) or isinstance(number, bool)):
        if isinstance(number, float) and number.is_integer():
            return int(number)
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if kind is float and not isinstance(number, (int, float)):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    return kind(number)


def _check_choice(key: str, value: Any, choices: tuple[str, ...], registered: str = "") -> None:
    """``registered``: the weightsync.device function naming what registered accelerators add
    to ``choices`` (looked up only for a value that is not built in)."""
    if value in choices:
        return
    if registered:
        from . import device  # torch comes with it: not for the built-in values

        choices = tuple(dict.fromkeys(choices + getattr(device, registered)()))
        if value in choices:
            return
    raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")
