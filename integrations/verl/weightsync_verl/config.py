"""Where the adapter finds its settings in verl's Hydra config.

Recipe adapter: a top-level ``weightsync`` block (every key is a SyncConfig field, e.g.
``+weightsync.transport=shm``). The trainer reads it and hands it to the workers inside the
coordinator, so no worker config carries it: verl turns ``actor_rollout_ref.rollout`` into
its strict ``RolloutConfig`` dataclass, which refuses keys it does not know.
Checkpoint-engine backend (verl >= 0.8): ``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync``
(verl hands that block to the backend's constructor). ``WEIGHTSYNC_*`` environment
variables win over both.
"""

from __future__ import annotations

from typing import Any

from weightsync import SyncConfig

BLOCK = "weightsync"
# where an earlier README put the block; verl's RolloutConfig refuses it with a TypeError
OLD_BLOCK = ("actor_rollout_ref", "rollout", "weight_sync")


class ConfigKeyError(ValueError):
    """A weightsync setting sits where verl cannot accept it."""


def plain(node: Any) -> Any:
    """An OmegaConf node as plain containers (resolving interpolations); anything else as is."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # verl always has omegaconf; plain dicts work without it
        return node
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    if hasattr(node, "get"):
        return node.get(key)
    return getattr(node, key, None)


def refuse_old_key(config: Any) -> None:
    """Raise ConfigKeyError if the trainer config still has ``actor_rollout_ref.rollout.weight_sync``
    (before verl's rollout workers fail on it with a bare TypeError)."""
    node = config
    for key in OLD_BLOCK:
        node = _get(node, key)
        if node is None:
            return
    keys = ", ".join(sorted(plain(node))) if isinstance(plain(node), dict) else "..."
    raise ConfigKeyError(
        f"'{'.'.join(OLD_BLOCK)}' ({keys}) is no longer read: verl turns actor_rollout_ref.rollout into its "
        f"RolloutConfig dataclass, which fails on unknown keys. Write the settings as a top-level block instead, "
        f"e.g. '+{BLOCK}.transport=shm' (or WEIGHTSYNC_TRANSPORT=shm)")


def sync_config(config: Any = None, **defaults: Any) -> SyncConfig:
    """SyncConfig from the trainer's whole config (its ``weightsync`` block), with ``defaults``
    below the user's keys and the environment on top."""
    refuse_old_key(config)
    mapping = plain(_get(config, BLOCK))
    base = SyncConfig.from_mapping(defaults) if defaults else None
    return SyncConfig.from_env(base=SyncConfig.from_mapping(mapping, base=base))
