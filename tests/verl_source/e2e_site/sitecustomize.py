"""Put on PYTHONPATH of the end-to-end run (tests/verl_source/test_recipe_e2e.py) only, so that
every process of it (driver, Ray workers, vLLM's engine process) gets the same CPU shims as
cpu_workers.py, without subclassing any of verl's workers:

- verl's workers ask for ``cpu:gloo,<device>:<nccl|hccl>``; on CPU the device is ``cpu`` and
  NCCL does not exist, so ``get_nccl_backend`` answers ``gloo`` where neither CUDA nor an NPU
  is present, and the resulting ``cpu:gloo,cpu:gloo`` (which torch refuses: one backend per
  device) becomes ``gloo``;
- ``torch.cpu`` lacks the RNG-state, empty_cache and allocator-statistics functions verl calls
  on its device namespace (statistics answer 0: the host allocator keeps none);
- NCCL is refused: ``torch.distributed.init_process_group`` / ``new_group`` with an NCCL
  backend and ``ray.util.collective.create_collective_group`` raise, and write a line to the
  file named by ``E2E_NCCL_REFUSALS`` (so a refusal that something catches still shows);
- a probe beside verl's own mismatch metrics (``calculate_debug_metrics`` compares the
  rollout's and the actor's *probabilities*): the max abs difference of the log-probs
  themselves, over the same response mask, logged as ``e2e/rollout_logprob_diff_max``;
- with ``E2E_CAPTURE_DIR`` set, a record of what the parity check of test_recipe_e2e.py
  needs (e2e_parity.py reads it): on the sending actor rank, every version's full state dict
  exactly as weightsync stages it (``weights-v<version>.pt``: the trainer's side is the
  truth); in the trainer, each step's batch where verl compares it (token ids, masks, the
  rollout's and the actor's log-probs, the batch's weightsync tag: ``batch-<n>.pt``, n the
  n-th call, one per step).

Each is applied right after the verl module that needs it is imported (the adapter's own
import hook, weightsync_verl.import_hook, which imports only the standard library), so
processes that never import verl pay nothing.
"""

from weightsync_verl.import_hook import after_import


def _device(module):
    import torch

    for name, fn in (("get_rng_state", torch.get_rng_state), ("set_rng_state", torch.set_rng_state),
                     ("manual_seed", torch.manual_seed), ("empty_cache", lambda: None),
                     # the host keeps no allocator statistics: verl logs them as perf/* metrics
                     ("max_memory_allocated", lambda *a: 0), ("max_memory_reserved", lambda *a: 0),
                     ("memory_allocated", lambda *a: 0), ("memory_reserved", lambda *a: 0)):
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    original = module.get_nccl_backend

    def get_nccl_backend():
        if module.is_cuda_available or module.is_npu_available:
            return original()
        return "gloo"

    module.get_nccl_backend = get_nccl_backend
    _refuse_nccl()


def _refused(what):
    import os

    path = os.environ.get("E2E_NCCL_REFUSALS")
    if path:
        with open(path, "a") as f:
            f.write(f"pid {os.getpid()}: {what}\n")
    raise AssertionError(f"NCCL refused in the end-to-end run: {what}")


def _refuse_nccl():
    import torch.distributed as dist

    if getattr(dist, "_e2e_refuses_nccl", False):
        return
    init, new = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, *args, **kwargs):
        if "nccl" in str(backend or ""):
            _refused(f"torch.distributed.init_process_group(backend={backend!r})")
        if backend == "cpu:gloo,cpu:gloo":  # verl's "cpu:gloo,<device>:<backend>" with device cpu
            backend = "gloo"
        return init(backend, *args, **kwargs)

    def new_group(*args, **kwargs):
        if "nccl" in str(kwargs.get("backend") or (args[2] if len(args) > 2 else "")):
            _refused(f"torch.distributed.new_group(backend={kwargs.get('backend')!r})")
        return new(*args, **kwargs)

    dist.init_process_group, dist.new_group, dist._e2e_refuses_nccl = init_process_group, new_group, True
    try:
        from ray.util.collective import collective
    except ImportError:
        return

    def create_collective_group(*args, **kwargs):
        _refused(f"ray.util.collective.create_collective_group{args[1:]!r} {kwargs!r}")

    collective.create_collective_group = create_collective_group


def _metrics(module):
    import torch

    original = module.calculate_debug_metrics

    def calculate_debug_metrics(data):
        out = original(data)
        rollout, actor = data.batch["rollout_log_probs"], data.batch["old_log_probs"]
        mask = data.batch["response_mask"][:, -data.batch["responses"].size(1):].bool()
        diff = torch.masked_select((rollout - actor).abs(), mask)
        out["e2e/rollout_logprob_diff_max"] = diff.max().item()
        out["e2e/rollout_logprob_diff_mean"] = diff.mean().item()
        out["e2e/response_tokens"] = int(mask.sum().item())
        _capture_batch(data)
        return out

    module.calculate_debug_metrics = calculate_debug_metrics


def _capture_dir():
    import os

    return os.environ.get("E2E_CAPTURE_DIR")


_batches = [0]


def _capture_batch(data):
    import os

    import torch

    where = _capture_dir()
    if not where:
        return
    _batches[0] += 1
    keys = ("prompts", "responses", "attention_mask", "response_mask", "rollout_log_probs", "old_log_probs")
    record = {k: data.batch[k].detach().cpu().clone() for k in keys}
    record["weight_version"] = data.meta_info.get("weight_version")
    torch.save(record, os.path.join(where, f"batch-{_batches[0]}.pt"))


def _sender(module):
    import os
    from collections.abc import Mapping

    import torch

    original = module.WeightSender.stage

    def stage(self, version, named_tensors, background=False):
        where = _capture_dir()
        if not where or not self.sends or background:
            return original(self, version, named_tensors, background)
        captured = {}
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors

        def recorded():
            for name, tensor in items:
                captured[name] = tensor.detach().to("cpu", copy=True)
                yield name, tensor

        handle = original(self, version, recorded(), background)
        torch.save(captured, os.path.join(where, f"weights-v{version}.pt"))
        return handle

    module.WeightSender.stage = stage


def _trainer(module):
    """With ``E2E_AHEAD_EVERY_OTHER`` set: the adapter stages ahead (right after update_actor)
    only for even steps' syncs, so one run shows verl's sync timing with and without it,
    interleaved."""
    import os

    if not os.environ.get("E2E_AHEAD_EVERY_OTHER"):
        return
    mixin = module.WeightSyncTrainerMixin
    original = mixin.weightsync_stage_ahead

    def weightsync_stage_ahead(self):
        if ((getattr(self, "global_steps", None) or 0) + 1) % 2:
            return None
        return original(self)

    mixin.weightsync_stage_ahead = weightsync_stage_ahead


_AFTER = {"verl.utils.device": _device, "verl.utils.debug.metrics": _metrics, "weightsync.sender": _sender,
          "weightsync_verl.recipe": _trainer}

after_import("e2e_site", _AFTER)
