"""The records that cross from the trainer to vLLM's workers, as vLLM's weight-transfer API
types them: dataclasses built from the plain dicts of ``init_weight_transfer_engine`` /
``update_weights`` (``parse_init_info`` / ``parse_update_info``: an unknown or missing field
is a ValueError there), each checked in ``__post_init__`` where it arrives.

The coordinator is reached by name: the worker may run in another process than whoever
created the coordinator (vLLM's engine core subprocess, a Ray worker of the executor), so
the handle itself does not travel, only what ``Coordinator.connect`` needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from weightsync.config import SyncConfig
from weightsync.errors import ConfigError

from . import BACKEND

try:  # vLLM >= 0.32: the trainer side has engines too
    from vllm.distributed.weight_transfer.base import TrainerInitInfo
except ImportError:  # vLLM 0.23 (vllm-ascend 0.23's): worker engines only, no trainer record
    TrainerInitInfo = None


def _name(owner: str, key: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{owner}: `{key}` must be a non-empty string, got {value!r}")


def _int(owner: str, key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: `{key}` must be an int >= {minimum}, got {value!r}")


def _target(info: Any) -> SyncConfig:
    """The checks both sides make of where the coordinator is and who receives; the config."""
    owner = type(info).__name__
    _name(owner, "coordinator", info.coordinator)
    _name(owner, "token", info.token)
    _name(owner, "receiver", info.receiver)
    return _config(owner, info.config)


def _config(owner: str, value: Any) -> SyncConfig:
    if not isinstance(value, dict):
        raise ValueError(f"{owner}: `config` must be a dict of weightsync SyncConfig fields, got {type(value).__name__}")
    try:
        return SyncConfig.load(value)
    except ConfigError as exc:
        raise ValueError(f"{owner}: `config` is not a valid weightsync SyncConfig: {exc}") from None


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """Worker side: which coordinator to attach a WeightReceiver to, and as whom.

    ``receiver`` is the name prefix; worker w of the engine registers as ``<receiver>-<w>``
    (w: its global rank across data-parallel replicas). ``ray_address``: the GCS address a
    worker process that is not part of a Ray job connects to (vLLM's engine core
    subprocess); a worker already inside a Ray process uses that process's connection."""

    coordinator: str
    token: str
    config: dict[str, Any] = field(default_factory=dict)
    receiver: str = "vllm"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.ray_address is not None:
            _name(type(self).__name__, "ray_address", self.ray_address)
        self.sync_config = _target(self)


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """One ``update_weights`` call: receive, verify and stage weightsync version ``version``.
    ``timeout_s`` bounds the wait for its bytes (default: the config's sync_timeout_s)."""

    version: int
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _int(owner, "version", self.version, 0)
        # vLLM 0.23's base record carries a sparse-update mode; weightsync sends whole tensors
        if getattr(self, "update_kind", "dense") != "dense":
            raise ValueError(f"{owner}: weightsync sends dense updates, got update_kind={self.update_kind!r}")
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float)
                                           or self.timeout_s <= 0):
            raise ValueError(f"{owner}: `timeout_s` must be a number > 0, got {self.timeout_s!r}")


if TrainerInitInfo is not None:
    @dataclass
    class WeightsyncTrainerInitInfo(TrainerInitInfo):
        """Trainer side (``WeightTransferTrainerFactory.trainer_init``): the coordinator the
        trainer created (name and token, as ``Coordinator.create`` returned them), the config
        both sides use, and how many receivers commit a version (vLLM workers, and any other
        rollout attached to the same coordinator). ``rank`` (keyword) is the trainer rank;
        rank 0 drives vLLM."""

        backend: ClassVar[str] = BACKEND

        coordinator: str
        token: str
        config: dict[str, Any] = field(default_factory=dict)
        receivers: int = 1
        receiver: str = "vllm"
        ray_address: str | None = None

        def __post_init__(self) -> None:
            self.sync_config = _target(self)
            _int(type(self).__name__, "receivers", self.receivers, 1)
            _int(type(self).__name__, "rank", self.rank, 0)

        def worker_init_info(self, ray_address: str | None, namespace: str | None) -> dict[str, Any]:
            """What the trainer sends with ``init_weight_transfer_engine`` (a WeightsyncInitInfo):
            the Ray address and namespace the trainer runs in, unless the config names them."""
            config = dict(self.config)
            if not config.get("namespace") and namespace:
                config["namespace"] = namespace
            return {"coordinator": self.coordinator, "token": self.token, "config": config,
                    "receiver": self.receiver, "ray_address": self.ray_address or ray_address}
