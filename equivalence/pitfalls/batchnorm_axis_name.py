"""Pitfall 2: linen ``BatchNorm`` inside pmap without ``axis_name``.

Under pmap each replica normalises with the statistics of its own G/D examples; the
sharded NNX model normalises with the statistics of the global batch (the partitioner
all-reduces them, as it does the gradients). With ``axis_name`` the pmap BatchNorm
``pmean``s its batch statistics and the two agree. The model is built here, as a
workload (data, not a code path), and run through the suite's own harness.

The Dense before BatchNorm has no bias, as in ResNets: BatchNorm subtracts the mean, so
such a bias has a true gradient of exactly 0, and Adam (which divides by the gradient's
size) turns its float32 rounding noise into full learning-rate steps. With a bias the
two paths differ there by ~5e-3 whatever the BatchNorm does.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from equivalence.core import harness
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.port.ports import ModelPort
from equivalence.core.run import sides
from equivalence.pitfalls.base import DAMAGE, CaseResult, matched, yes
from legacy_pmap import train as legacy

NUMBER = 2
NAME = 'batchnorm_axis_name'
TITLE = 'linen BatchNorm without axis_name in pmap'
DESCRIPTION = (
    'nn.BatchNorm(use_running_average=False) in a pmap step, without axis_name=<pmap axis>. '
    'Bites whenever the model has BatchNorm: each device normalises with its own per-device batch, '
    'the sharded NNX model with the global batch, so losses, parameters and running stats differ.'
)


class LinenBNMLP(nn.Module):
    """20 -> 30 (no bias) -> BatchNorm -> relu -> 1; ``axis_name`` None is the trap."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        h_BxH = nn.Dense(30, use_bias=False, name='hidden')(x_BxF)
        h_BxH = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name, name='bn')(h_BxH)
        return nn.Dense(1, name='out')(nn.relu(h_BxH))


class NnxBNMLP(nnx.Module):
    """The same model in NNX: its BatchNorm sees the global batch, sharded over the mesh."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(20, 30, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(30, use_running_average=False, rngs=rngs)
        self.out = nnx.Linear(30, 1, rngs=rngs)

    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.bn(self.hidden(x_BxF))))


def linen_loss(model, params, model_state, batch, noise):
    pred_Bx1, new_state = model.apply({'params': params, **model_state}, batch['x'], mutable=['batch_stats'])
    return jnp.mean((pred_Bx1 - batch['y']) ** 2, axis=-1), new_state


def nnx_loss(model, batch, noise):
    return jnp.mean((model(batch['x']) - batch['y']) ** 2, axis=-1)


def workload(axis_name: str | None) -> ModelPort:
    """The mlp workload with BatchNorm, pmap side with or without ``axis_name``."""
    return dataclasses.replace(
        workloads.get('mlp'),
        name=f'bn-mlp (axis_name={axis_name})',
        legacy_model=lambda: LinenBNMLP(axis_name=axis_name),
        nnx_model=lambda rngs: NnxBNMLP(rngs=rngs),
        legacy_loss=linen_loss,
        nnx_loss=nnx_loss,
    )


def run(devices: int) -> CaseResult:
    config = RunConfig(workload='mlp', devices=devices, steps_per_call=5, calls=2, batch_size=64)
    # the wrong run's differences are read, not its diagnosis: it is not diagnosed (nor located)
    wrong, fixed = harness.run(workload(None), config, diagnose=False), harness.run(workload(legacy.AXIS), config)
    spread = sides.replica_spread(wrong.legacy.raw.model_state)
    losses, stats, params = (wrong.report.max_abs(g) for g in ('losses', 'model_state', 'params'))
    fixed_spread = sides.replica_spread(fixed.legacy.raw.model_state)
    return CaseResult(
        symptom=f'running stats differ by {spread:.1e} between replicas; vs NNX global-batch BatchNorm: '
        f'losses {losses:.1e}, running stats {stats:.1e}, params {params:.1e} apart after {config.steps} steps',
        threshold=f'losses, running stats and replica spread of the stats > {DAMAGE:g}',
        damage_shown=min(spread, losses, stats) > DAMAGE,
        fix=f'axis_name={legacy.AXIS!r}: running stats {fixed.report.max_abs("model_state"):.1e}, '
        f'losses {fixed.report.max_abs("losses"):.1e} from NNX, within tolerance: {yes(matched(fixed))}',
        fix_matches=matched(fixed) and fixed_spread == 0.0,
        details={
            'steps': config.steps,
            'replica_spread_batch_stats': spread,
            'max_abs': {g: wrong.report.max_abs(g) for g in ('losses', 'model_state', 'params')},
            'fixed_max_abs': {g: fixed.report.max_abs(g) for g in ('losses', 'model_state', 'params')},
            'fixed_replica_spread_batch_stats': fixed_spread,
        },
    )
