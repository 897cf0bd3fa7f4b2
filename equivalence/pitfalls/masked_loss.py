"""Pitfall 4: a masked (weighted) loss, averaged per device and then ``pmean``'d.

The global batch of 100 examples is padded to a multiple of D (104 on 8 devices; on a D
that divides 100, the next batch it does not divide) and
the padding is masked out, so the last device holds fewer valid examples. The pmap
step's per-device weighted mean ``sum(l*m)/sum(m)``, then ``pmean``, gives each *device*
weight 1/D: the examples of a device with fewer valid rows count more. The global
weighted mean is ``psum(sum(l*m)) / psum(sum(m))``; the sharded side computes it directly.

All three losses are written as per-example values whose plain mean is the intended
reduction, so that the suite's unchanged steps (``mean`` of the per-example losses, then
``pmean`` on the pmap side) and harness run them:

- wrong pmap: ``l*m * B / sum_local(m)``        -> mean = the local weighted mean
- fixed pmap: ``l*m * B * D / psum(sum_local(m))`` -> pmean of means = the global weighted mean
- NNX:        ``l*m * G / sum(m)``               -> mean = the global weighted mean
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from equivalence.core import harness
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.port.ports import ModelPort
from equivalence.pitfalls.base import DAMAGE, CaseResult, indivisible, matched, padded, yes
from legacy_pmap import losses as legacy_losses
from legacy_pmap import train as legacy
from nnx_sharded import losses as nnx_losses

NUMBER = 4
NAME = 'masked_loss'
TITLE = 'masked loss: pmean of per-device means'
DESCRIPTION = (
    'A masked or weighted loss averaged on each device, then pmean-ed. '
    'Bites when devices hold different numbers of valid examples (padding, variable lengths): '
    'the result is not the global weighted mean. Fix: psum numerator and denominator.'
)


def padded_mlp_data(valid: int, devices: int):
    """The mlp data for ``valid`` examples, zero-padded to a multiple of ``devices``, with a mask."""

    def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict[str, np.ndarray]:
        data = workloads.mlp_data(rng, n_steps, valid)
        pad = [(0, 0), (0, batch - valid)]
        out = {k: np.pad(v, pad + [(0, 0)] * (v.ndim - 2)) for k, v in data.items()}
        mask = np.zeros((n_steps, batch), np.float32)
        mask[:, :valid] = 1.0
        return {**out, 'mask': mask}

    return make_data


def legacy_local_mean(model, params, model_state, batch, noise):
    losses_B, model_state = legacy_losses.mlp_loss(model, params, model_state, batch, noise)
    m_B = batch['mask']
    return losses_B * m_B * m_B.shape[0] / jnp.sum(m_B), model_state


def legacy_global_mean(model, params, model_state, batch, noise):
    losses_B, model_state = legacy_losses.mlp_loss(model, params, model_state, batch, noise)
    m_B = batch['mask']
    n_valid = jax.lax.psum(jnp.sum(m_B), legacy.AXIS)
    return losses_B * m_B * m_B.shape[0] * jax.lax.psum(1, legacy.AXIS) / n_valid, model_state


def nnx_global_mean(model, batch, noise):
    m_G = batch['mask']
    return nnx_losses.mlp_loss(model, batch, noise) * m_G * m_G.shape[0] / jnp.sum(m_G)


def workload(legacy_loss, devices: int) -> ModelPort:
    return dataclasses.replace(
        workloads.get('mlp'),
        name='masked-mlp',
        legacy_loss=legacy_loss,
        nnx_loss=nnx_global_mean,
        make_data=padded_mlp_data(indivisible(devices), devices),
    )


def run(devices: int) -> CaseResult:
    valid = indivisible(devices)
    batch = padded(valid, devices)
    config = RunConfig(workload='mlp', devices=devices, steps_per_call=5, calls=2, batch_size=batch)
    wrong = harness.run(workload(legacy_local_mean, devices), config, diagnose=False)  # its differences are read
    fixed = harness.run(workload(legacy_global_mean, devices), config)
    valid_last = valid - (devices - 1) * (batch // devices)
    return CaseResult(
        symptom=f'{valid} examples padded to {batch} ({valid_last} of {batch // devices} valid on the last device): '
        f'step-1 loss {abs(wrong.legacy.losses[0] - wrong.new.losses[0]):.1e} off, losses up to '
        f'{wrong.report.max_abs("losses"):.1e}, params {wrong.report.max_abs("params"):.1e} after {config.steps} steps',
        threshold=f'loss and parameter difference > {DAMAGE:g}',
        damage_shown=min(wrong.report.max_abs('losses'), wrong.report.max_abs('params')) > DAMAGE,
        fix=f'psum(sum l*m) / psum(sum m): losses {fixed.report.max_abs("losses"):.1e}, '
        f'params {fixed.report.max_abs("params"):.1e} from NNX, within tolerance: {yes(matched(fixed))}',
        fix_matches=matched(fixed),
        details={
            'valid': valid,
            'padded_batch': batch,
            'valid_on_last_device': valid_last,
            'wrong_max_abs': {g: wrong.report.max_abs(g) for g in ('losses', 'params', 'opt_state')},
            'fixed_max_abs': {g: fixed.report.max_abs(g) for g in ('losses', 'params', 'opt_state')},
        },
    )
