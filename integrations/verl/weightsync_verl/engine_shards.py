"""Every FSDP2 actor rank hands the checkpoint-engine backend its own shards (verl >= 0.8).

verl's engine worker (``ActorRolloutRefWorker.update_weights``) gives every checkpoint-engine
backend ``engine.get_per_tensor_param()``, whose FSDP2 export calls ``full_tensor()`` on each
parameter: an all-gather per tensor on every rank, before weightsync sees a byte. verl itself
branches there for its ``delta_sharded`` backend (it hands that one the engine). This adds the
same kind of branch for the backend ``weightsync``: where the engine is verl's FSDP engine over
FSDP2 and its export would only gather (no LoRA, no QAT, no packed MoE experts to unfuse), the
backend gets the same names in the same order with each DTensor left as it is, so every rank
sends its own rows (docs/sharded.md). Anything else goes through verl's own method unchanged.

Installed by importing weightsync_verl.checkpoint_engine (verl imports it in each actor worker
through ``custom_backend_module`` before it builds the backend): the method is replaced on the
class, so the subclasses verl's trainers use (``DetachActorWorker``) take it too.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from typing import Any

from .import_hook import after_import

WORKERS_MODULE = "verl.workers.engine_workers"
FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
BACKEND = "weightsync"


def local_shards(engine: Any) -> Iterator[tuple[str, Any]] | None:
    """What verl's FSDP engine's ``get_per_tensor_param()`` yields, each DTensor as this rank's
    shard instead of ``full_tensor()``; None where that export does more than gather."""
    fsdp = sys.modules.get(FSDP_ENGINE_MODULE)
    if fsdp is None or type(engine).get_per_tensor_param is not fsdp.FSDPEngine.get_per_tensor_param:
        return None  # another engine (Megatron, or one that exports its own way, as veomni)
    from torch.distributed.tensor import DTensor
    from verl.utils.device import get_device_id
    from verl.utils.fsdp_utils import fsdp_version
    from verl.utils.model import convert_weight_keys

    module = engine.module
    inner = getattr(module, "_fsdp_wrapped_module", module)
    if fsdp_version(module) != 2 or hasattr(inner, "peft_config") or getattr(engine, "_qat_enabled", False):
        return None
    params = convert_weight_keys(module.state_dict(), inner)
    if any(".mlp.experts." in name and p.dim() == 3 for name, p in params.items()):
        return None  # packed experts, which verl's export unfuses from the full tensor
    device = get_device_id()  # where verl's export moves each parameter (FSDP2's CPU offload policy)
    return ((name, p.to(device, non_blocking=True) if isinstance(p, DTensor) else p) for name, p in params.items())


def patch_module(module: Any) -> None:
    cls = getattr(module, "ActorRolloutRefWorker", None)
    verl_update = getattr(cls, "update_weights", None)
    if verl_update is None or getattr(verl_update, "_weightsync_shards", False):
        return

    @functools.wraps(verl_update)  # keeps verl's @register dispatch attributes
    async def update_weights(self: Any, global_steps: int | None = None, mode: str = "auto") -> Any:
        backend = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
        shards = local_shards(self.actor.engine) if backend == BACKEND else None
        if shards is None:
            return await verl_update(self, global_steps=global_steps, mode=mode)
        metrics = await self.checkpoint_engine.send_weights(shards, global_steps=global_steps)
        return metrics or {}

    update_weights._weightsync_shards = True
    cls.update_weights = update_weights


def install() -> None:
    """Patch verl's engine worker in this process, now if imported, else as it is imported.
    Idempotent."""
    after_import(__name__, {WORKERS_MODULE: patch_module})
    if WORKERS_MODULE in sys.modules:
        patch_module(sys.modules[WORKERS_MODULE])
