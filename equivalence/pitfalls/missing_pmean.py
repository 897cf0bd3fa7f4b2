"""Pitfall 1: the pmap step forgets ``lax.pmean`` of the gradients.

Nothing fails: every replica applies its own per-device gradient, so the "replicated"
parameters silently become D different models, and reading replica 0 back reports one
of them. The wrong step below is ``legacy_pmap.train.make_step_fn`` minus that one line.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from equivalence.core import harness
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import ModelPort
from equivalence.core.run import setups, sides
from equivalence.core.run.inputs import make_inputs
from equivalence.core.state import convert
from equivalence.pitfalls.base import DAMAGE, CaseResult, matched, max_abs_diff, yes
from legacy_pmap import train as legacy

NUMBER = 1
NAME = 'missing_pmean'
TITLE = 'gradient pmean missing in the pmap step'
DESCRIPTION = (
    'A pmap step that applies the per-device gradient without lax.pmean(grads, axis). '
    'Bites silently: replicas drift apart and replica 0 is not the model the global batch trains.'
)


def step_without_pmean(model, per_example_loss, tx: optax.GradientTransformation):
    """The suite's pmap step (``legacy_pmap.train.make_step_fn``) with the gradient pmean left out."""

    def loss_fn(params, model_state, batch):
        losses_B, model_state = per_example_loss(model, params, model_state, batch, {})
        return jnp.mean(losses_B), model_state

    def step(carry, batch):
        rng, state = carry
        (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state.model_state, batch)
        # the trap: grads = jax.lax.pmean(grads, axis_name=legacy.AXIS) is missing
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state)
        return (rng, new_state), jax.lax.pmean(loss, axis_name=legacy.AXIS)

    return step


def run_wrong(wl: ModelPort, config: Run, variables: dict, calls: list[dict], rng):
    """score_sde's loop over the calls, with the wrong step; returns the replicated state."""
    tx = wl.make_tx(1.0)
    devices = jax.devices()[: config.devices]
    pstate = legacy.replicate(legacy.create_state(variables, tx, None), devices)
    setup = setups.LegacySetup(
        legacy.make_fused_call(step_without_pmean(wl.legacy_model(), wl.legacy_loss, tx), devices), pstate, config
    )
    for batch_KxG in calls:
        rng, args = setup.call_args(rng, batch_KxG)
        (_, setup.pstate), loss_DxK = setup.p_train_step(*args)
        np.asarray(loss_DxK)  # block: one call in flight
    return setup.pstate


def run(devices: int) -> CaseResult:
    wl = workloads.get('mlp')
    config = RunConfig(workload='mlp', devices=devices, steps_per_call=5, calls=4, batch_size=wl.default_batch)
    fixed = harness.run(wl, config)  # the suite's pmap step (with pmean) against the NNX reference
    variables, calls, rng = make_inputs(wl, config)
    pstate = run_wrong(wl, config, variables, calls, rng)
    reference = fixed.new.final['params']
    spread = sides.replica_spread(pstate.params)
    replicas = [convert.flatten(jax.tree.map(lambda x, d=d: np.asarray(x)[d], pstate.params)) for d in range(devices)]
    to_ref = max(max_abs_diff(reference, r) for r in replicas)
    fixed_spread = sides.replica_spread(fixed.legacy.raw.params)
    return CaseResult(
        symptom=f'after {config.steps} steps the {devices} replicas are {spread:.1e} apart (max |param|), '
        f'and up to {to_ref:.1e} from the reference',
        threshold=f'replica spread and distance to the reference > {DAMAGE:g}',
        damage_shown=spread > DAMAGE and to_ref > DAMAGE,
        fix=f'with pmean: replica spread {fixed_spread:.1e}, '
        f'params {fixed.report.max_abs("params"):.1e} from the NNX reference, within tolerance: '
        f'{yes(matched(fixed))}',
        fix_matches=matched(fixed) and fixed_spread == 0.0,
        details={
            'steps': config.steps,
            'replica_spread': spread,
            'max_abs_to_reference': to_ref,
            'fixed_replica_spread': fixed_spread,
            'fixed_max_abs_params': fixed.report.max_abs('params'),
        },
    )
