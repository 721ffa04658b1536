"""Internal. The entry points ``weightsync doctor`` reports: which vLLM weight-transfer engines this
environment has (vLLM's own factory registries, after vLLM's own plugin loader ran, so the
names are the ones ``weight_transfer_config={"backend": ...}`` accepts here, ours included),
and which of our verl entry points the installed verl can use.

Nothing here imports weightsync_vllm or weightsync_verl: vLLM's loader registers ours from
its ``vllm.general_plugins`` entry point, and verl's are looked up, not imported.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ..transports.ipc import support as caps

BACKEND = "weightsync"  # the name weightsync_vllm registers (weightsync_vllm.BACKEND)

# doctor's report is a JSON document (``--json`` prints it; people paste it into bug reports): plain
# data by design, read back by its text form
Report = dict[str, Any]


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # a parent package that is absent, or fails to import
        return False


def vllm_engines() -> Report:
    """vLLM's weight-transfer engines here: worker-side names, trainer-side names, whether
    ours is among them; or why there are none."""
    version = caps.package_version("vllm")
    if not _has_module("vllm"):
        return {"available": False, "vllm": None, "reason": "vLLM is not installed"}
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as exc:
        return {"available": False, "vllm": version,
                "reason": f"vLLM {version} has no weight-transfer API (vllm.distributed.weight_transfer, "
                          f"vLLM >= 0.23): {exc}"}
    from vllm.plugins import load_general_plugins

    # vLLM's loader, as every vLLM process runs it: platform patches (vllm-ascend re-points
    # "nccl" / "ipc" to HCCL / NPU IPC) and plugins (ours) register their engines here
    load_general_plugins()
    worker = sorted(WeightTransferEngineFactory._registry)
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        trainer: list[str] | None = sorted(WeightTransferTrainerFactory._registry)
    except ImportError:  # vLLM 0.23: trainers call the engine's static trainer_send_weights
        trainer = None
    ours = BACKEND in worker
    reason = (f'backend "{BACKEND}" registered (weightsync_vllm plugin)' if ours else
              f'backend "{BACKEND}" is not registered: weightsync_vllm\'s vllm.general_plugins entry point did not '
              "load (weightsync installed without it, or VLLM_PLUGINS excludes it)")
    if _has_module("vllm_ascend"):
        reason += "; vllm-ascend installed: on an NPU its platform patch makes \"nccl\" / \"ipc\" HCCL / NPU IPC"
    return {"available": True, "vllm": version, "worker_engines": worker, "trainer_engines": trainer,
            "weightsync": ours, "reason": reason}


def verl_entry_points() -> dict[str, Report]:
    """Our verl entry points and whether the installed verl (or verl tree on sys.path) has
    what each plugs into."""
    version = caps.package_version("verl")
    ours = _has_module("weightsync_verl")
    missing = "weightsync_verl is not installed (it ships with weightsync)"
    engine = _has_module("verl.checkpoint_engine")
    recipe = _has_module("recipe.one_step_off_policy")
    one_step_off = _has_module("verl.experimental.one_step_off_policy")
    return {
        "checkpoint_engine": {
            "available": ours and engine,
            "what": "checkpoint-engine backend weightsync_verl.checkpoint_engine (verl >= 0.8: one-step-off and "
                    "fully-async)",
            "reason": missing if not ours else (f"verl {version} has verl.checkpoint_engine" if engine else
                                                f"verl {version or '(not installed)'} has no verl.checkpoint_engine"),
        },
        "stage_ahead": {
            "available": ours and engine and one_step_off,
            "what": "one-step-off stage ahead VERL_USE_EXTERNAL_MODULES=weightsync_verl.plugin_stage_ahead (verl >= 0.8, "
                    "with the checkpoint-engine backend)",
            "reason": missing if not ours else (f"verl {version} has verl.experimental.one_step_off_policy"
                                                if engine and one_step_off else
                                                f"verl {version or '(not installed)'} has no "
                                                "verl.experimental.one_step_off_policy with a checkpoint engine"),
        },
        "recipe_sync_group": {
            "available": ours and recipe,
            "what": "one-step-off recipe sync group python -m weightsync_verl.one_step_off (verl v0.5.0 - v0.7.0 "
                    "source tree)",
            "reason": missing if not ours else ("recipe.one_step_off_policy importable (a verl source tree)"
                                                if recipe else "recipe.one_step_off_policy not importable: run from "
                                                "the verl source tree that has recipe/"),
        },
    }


def format_entry_points(vllm: Report, verl: dict[str, Report]) -> list[str]:
    lines = ["", "vLLM weight-transfer engines:"]
    if vllm["available"]:
        lines.append(f"  worker   {', '.join(vllm['worker_engines'])}")
        lines.append("  trainer  " + (", ".join(vllm["trainer_engines"]) if vllm["trainer_engines"] is not None
                                      else "- (vLLM 0.23: no trainer engines)"))
        lines.append(f"  {'yes' if vllm['weightsync'] else 'no '}  {vllm['reason']}")
    else:
        lines.append(f"  no   {vllm['reason']}")
    lines += ["", "verl entry points:"]
    for name, e in verl.items():
        lines.append(f"  {name:<18} {'yes' if e['available'] else 'no '}  {e['what']}: {e['reason']}")
    return lines
