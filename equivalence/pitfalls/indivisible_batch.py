"""Pitfall 7: a global batch that does not divide by the device count (100 on 8 devices).

Both layouts need G % D == 0: pmap's ``[D, K, G/D, ...]`` reshape, and a ``P(None, 'data')``
sharding of ``[K, G, ...]``. The raw errors name shapes, not the fix. The suite checks this
in ``RunConfig`` and names the nearest valid batches. The fixes: a divisible batch, or pad
to one and mask the padding, with the global weighted mean of pitfall 4.
"""

import jax
import jax.numpy as jnp
import numpy as np

from equivalence.core.port import workloads
from equivalence.core.port.config import ConfigError, RunConfig
from equivalence.core.state import convert
from equivalence.pitfalls import masked_loss
from equivalence.pitfalls.base import CaseResult, first_line, indivisible, max_abs_diff, padded, within_tol, yes
from legacy_pmap import losses as legacy_losses
from legacy_pmap import train as legacy
from nnx_sharded import sharding

NUMBER = 7
NAME = 'indivisible_batch'
TITLE = 'global batch not divisible by the device count'
DESCRIPTION = (
    "A global batch that does not divide by D, e.g. the original question's 100 on 8 devices. "
    'Bites at the first call, with an error about shapes. Fix: a divisible batch, or pad and mask (pitfall 4).'
)


def raw_errors(batch_KxG: dict, devices: int) -> dict[str, str]:
    """What each path raises when handed the indivisible batch, first line only."""
    errors = {}
    attempts = {
        'pmap layout (legacy shard_batch)': lambda: legacy.shard_batch(batch_KxG['x'], devices),
        'mesh placement (device_put)': lambda: sharding.place_batch(batch_KxG, sharding.make_mesh(devices)),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except Exception as e:  # noqa: BLE001 -- the point is to show whatever the user sees
            errors[name] = first_line(e)
    return errors


def suite_error(batch: int, devices: int) -> str | None:
    try:
        RunConfig(devices=devices, batch_size=batch)
    except ConfigError as e:
        return str(e)
    return None


def masked_value_and_grad(model, params, batch_1xG: dict) -> dict[str, np.ndarray]:
    """Loss and gradients of the global weighted mean over the (only) step of ``batch_1xG``."""

    def loss_fn(p, batch_G):
        losses_G, _ = legacy_losses.mlp_loss(model, p, {}, batch_G, {})
        return jnp.sum(losses_G * batch_G['mask']) / jnp.sum(batch_G['mask'])

    step = jax.jit(lambda p, b: jax.value_and_grad(loss_fn)(p, {k: v[0] for k, v in b.items()}))
    loss, grads = step(params, batch_1xG)
    return {'loss': np.asarray(loss), **convert.flatten(grads)}


def run(devices: int) -> CaseResult:
    batch = indivisible(devices)
    wl = workloads.get('mlp')
    data = wl.make_data(np.random.default_rng(0), 1, batch)
    errors, message = raw_errors(data, devices), suite_error(batch, devices)
    divisible = suite_error(batch - batch % devices, devices) is None
    params = wl.legacy_model().init(jax.random.PRNGKey(0), data['x'][0, :1])['params']
    ref = masked_value_and_grad(wl.legacy_model(), params, {**data, 'mask': np.ones((1, batch), np.float32)})
    padded_1xP = masked_loss.padded_mlp_data(batch, devices)(np.random.default_rng(0), 1, padded(batch, devices))
    got = masked_value_and_grad(
        wl.legacy_model(), params, sharding.place_batch(padded_1xP, sharding.make_mesh(devices))
    )
    return CaseResult(
        symptom=' | '.join(f'{k}: {v}' for k, v in errors.items()),
        threshold='both paths raise, and the suite raises ConfigError naming the nearest valid batches',
        damage_shown=len(errors) == 2 and message is not None,
        fix=f'suite: "{message}"; padded to {padded_1xP["x"].shape[1]} with a mask on {devices} devices: '
        f'loss and grads {max_abs_diff(ref, got):.1e} from the unpadded batch on one device, '
        f'within tolerance: {yes(within_tol(ref, got))}',
        fix_matches=divisible and within_tol(ref, got),
        details={
            'batch': batch,
            'devices': devices,
            'raw_errors': errors,
            'suite_error': message,
            'padded_batch': int(padded_1xP['x'].shape[1]),
            'padded_max_abs_diff': max_abs_diff(ref, got),
        },
    )
