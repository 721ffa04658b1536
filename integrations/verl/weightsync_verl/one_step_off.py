"""``python -m weightsync_verl.one_step_off <overrides>``: the recipe's ``main_ppo`` with
weightsync in place of its NCCL sync group. Run it where ``python -m
recipe.one_step_off_policy.main_ppo`` runs (the verl source tree), with the same overrides
plus ``+weightsync.<key>=<value>`` (top level) as needed."""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

from .recipe import RECIPE, enable_in_ray_workers, install

CONFIG_NAME = "one_step_off_ppo_trainer"  # every generation's main_ppo (v0.5.0 - v0.7.0)


def recipe_entry(recipe_main: Any) -> Callable[[], Any]:
    """The recipe's Hydra main with its config directory given as a path.

    ``main_ppo`` declares ``@hydra.main(config_path="config")``, which Hydra resolves against
    the *module* when that module is not ``__main__``: imported from here it looks for a
    package ``recipe.one_step_off_policy.config``, which verl's tree does not have (recipe/
    is a namespace package, config/ a plain directory), and stops with "Primary config module
    ... not found". Run as ``python -m recipe...main_ppo`` it resolves against the file; so
    does this. ``--config-name`` / ``--config-path`` on the command line still override."""
    import hydra

    task = inspect.unwrap(recipe_main.main)  # hydra.main keeps the function under functools.wraps
    config_dir = os.path.join(os.path.dirname(os.path.abspath(recipe_main.__file__)), "config")
    return hydra.main(config_path=config_dir, config_name=CONFIG_NAME, version_base=None)(task)


def main() -> None:
    install()
    enable_in_ray_workers()
    try:
        recipe_main = importlib.import_module(f"{RECIPE}.main_ppo")
    except ImportError as exc:
        raise SystemExit(f"cannot import {RECIPE}.main_ppo ({exc}): run from a verl source tree that has "
                         "recipe/one_step_off_policy (verl v0.5.0-0.7); for verl >= 0.8 use "
                         "checkpoint_engine.custom_backend_module=weightsync_verl.checkpoint_engine") from None
    recipe_entry(recipe_main)()


if __name__ == "__main__":
    main()
