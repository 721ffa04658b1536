"""Loaded after ``weightsync_verl.plugin_stage_ahead`` by ``VERL_USE_EXTERNAL_MODULES``: the trainer
stages ahead only for the syncs of even steps, so one run holds both kinds of step side by
side, interleaved (odd steps' versions are staged by verl's sync itself, at the barrier)."""

from weightsync_verl.stage_ahead import StageAheadMixin

_stage_ahead = StageAheadMixin.weightsync_stage_ahead


def weightsync_stage_ahead(self) -> bool:
    if (self.global_steps + 1) % 2:
        return False
    return _stage_ahead(self)


StageAheadMixin.weightsync_stage_ahead = weightsync_stage_ahead
