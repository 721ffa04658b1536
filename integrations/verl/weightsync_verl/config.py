"""Where the adapter finds its settings in verl's Hydra config.

Recipe adapter: ``actor_rollout_ref.rollout.weight_sync`` (every key is a SyncConfig field,
e.g. ``+actor_rollout_ref.rollout.weight_sync.transport=shm``). Checkpoint-engine backend:
``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync`` (verl hands that
block to the backend's constructor). ``WEIGHTSYNC_*`` environment variables win over both.
"""

from __future__ import annotations

from typing import Any

from weightsync import SyncConfig

BLOCK = "weight_sync"


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


def sync_config(config: Any = None, **defaults: Any) -> SyncConfig:
    """SyncConfig from a trainer config (the whole one, ``actor_rollout_ref``, or its
    ``rollout`` part), with ``defaults`` below the user's keys and the environment on top."""
    block = config
    for key in ("actor_rollout_ref", "rollout"):
        inner = _get(block, key)
        if inner is not None:
            block = inner
    mapping = plain(_get(block, BLOCK)) if block is not None else None
    base = SyncConfig.from_mapping(defaults) if defaults else None
    return SyncConfig.from_env(base=SyncConfig.from_mapping(mapping, base=base))
