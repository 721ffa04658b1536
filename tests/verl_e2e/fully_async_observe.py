"""The fully-async run's batch tap, loaded after ``e2e_observe`` by ``VERL_USE_EXTERNAL_MODULES``
(run_fully_async.py). verl 0.9.1's fully-async recipe keeps ``bypass_mode=True`` (its yaml:
old_log_prob := the rollout's log-probs), so ``calculate_debug_metrics``, where the one-step-off
run records its batches, is never called. Here the batch is taken where the trainer collects
its metrics from the samples it got off the message queue
(``FullyAsyncTrainer._collect_metrics_from_samples``, called by ``_fit_generate`` for every
training step, looked up on the instance at each call), together with the weight version the
trainer holds at that moment (``current_param_version``): the figure the staleness bound is
about. Observation only: verl's method runs unchanged; with ``VERL_E2E_RECORD`` unset nothing
is written.
"""

from __future__ import annotations

from e2e_observe import RECORD, _record_batch
from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer as _Actor

# verl decorates the trainer with @ray.remote: the module's name holds Ray's ActorClass, and
# the actor runs the subclass Ray made of verl's class, which carries its own copy of every
# method (measured: patching verl's class alone left the subclass's method verl's)
_RUN_CLASS = _Actor.__ray_metadata__.modified_class
_verl_collect = _RUN_CLASS._collect_metrics_from_samples


def _collect_metrics_from_samples(self, batch, metrics):
    """verl's method, then the batch recorded with the trainer's version and the step's
    ``fully_async/*`` metrics verl just computed. verl's file logger writes them aggregated,
    one record per version, and measured there the counters are those after the version's
    first step: cumulative stale responses 0, 4, 12, 20 where the batches give 0, 8, 16, 23,
    and the one partial rollout, in the last step, never appeared."""
    out = _verl_collect(self, batch, metrics)
    if RECORD:
        verl_metrics = {k: float(v) for k, v in metrics.items()
                        if k.startswith(("fully_async/partial/", "fully_async/count/"))}
        _record_batch(batch, trainer_version=int(self.current_param_version), verl_metrics=verl_metrics)
    return out


_RUN_CLASS._collect_metrics_from_samples = _collect_metrics_from_samples
