"""``VERL_USE_EXTERNAL_MODULES=weightsync_verl.plugin_stage_ahead``: verl imports this module in
every process (from ``import verl``, before its trainers), and it installs weightsync_verl.stage_ahead:
verl's one-step-off trainer stages each version right after ``update_actor``."""

from .stage_ahead import install

install()
