"""``python -m weightsync_verl.one_step_off <overrides>``: the recipe's ``main_ppo`` with
weightsync in place of its NCCL sync group. Run it where ``python -m
recipe.one_step_off_policy.main_ppo`` runs (the verl source tree), with the same overrides
plus ``+weightsync.<key>=<value>`` (top level) as needed."""

from __future__ import annotations

import importlib

from .recipe import RECIPE, enable_in_ray_workers, install


def main() -> None:
    install()
    enable_in_ray_workers()
    try:
        recipe_main = importlib.import_module(f"{RECIPE}.main_ppo")
    except ImportError as exc:
        raise SystemExit(f"cannot import {RECIPE}.main_ppo ({exc}): run from a verl source tree that has "
                         "recipe/one_step_off_policy (verl v0.5.0-0.7); for verl >= 0.8 use "
                         "checkpoint_engine.custom_backend_module=weightsync_verl.checkpoint_engine") from None
    recipe_main.main()


if __name__ == "__main__":
    main()
