"""Pitfall 5: a ``shard_map`` port of the pmap step that keeps ``pmean(grads)``.

With ``check_vma=True`` (the default) ``shard_map`` tracks which values vary across the
mesh axis. A replicated parameter does not vary; the per-device loss does; so the
transpose of the implicit broadcast sums the cotangents: ``jax.grad`` of the per-device
mean loss already returns the *sum* over devices of the per-device gradients, the same
on every device. ``pmean`` of that sum leaves it unchanged: D times the gradient.

Two correct forms, both below: (A) keep ``check_vma=True`` and ``pmean`` the *loss*
before differentiating, not the gradient; (B) ``check_vma=False``, pmap's semantics,
where the gradient is per-device and the explicit ``pmean`` is right.
With Adam the damage hides (its step is invariant to the gradient's scale, up to eps);
with SGD, clipping or any gradient statistic it is a D-fold error.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from equivalence.core import harness
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.state import convert
from equivalence.pitfalls.base import CaseResult, max_abs_diff, within_tol, yes
from legacy_pmap import losses as legacy_losses
from nnx_sharded import sharding

NUMBER = 5
NAME = 'shard_map_pmean'
TITLE = 'shard_map port keeps the explicit pmean'
DESCRIPTION = (
    'A pmap step moved into jax.shard_map(check_vma=True) with its lax.pmean(grads) kept. '
    'Bites on every replicated parameter: its gradient is already summed over the axis, '
    'so it comes out D times too big.'
)


def grad_fns(model, mesh) -> dict:
    """The wrong port and the two correct ones, each ``(params, batch) -> grads``."""

    def local_loss(params, batch):
        return jnp.mean(legacy_losses.mlp_loss(model, params, {}, batch, {})[0])

    def shard(body, check_vma: bool):
        specs = (P(), P(sharding.DATA))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=check_vma))

    pmean = lambda tree: jax.lax.pmean(tree, sharding.DATA)  # noqa: E731
    return {
        'wrong': shard(lambda p, b: pmean(jax.grad(local_loss)(p, b)), check_vma=True),
        'A: pmean the loss, check_vma=True': shard(lambda p, b: jax.grad(lambda q: pmean(local_loss(q, b)))(p), True),
        'B: pmean the grads, check_vma=False': shard(lambda p, b: pmean(jax.grad(local_loss)(p, b)), False),
        'reference': jax.jit(jax.grad(local_loss)),  # one global mean, no shard_map
    }


def run(devices: int) -> CaseResult:
    wl = workloads.get('mlp')
    config = RunConfig(workload='mlp', devices=devices, steps_per_call=1, calls=1, batch_size=wl.default_batch)
    fed = harness.prepare(wl, config).inputs  # the harness's own preparation (pre-flight, inputs)
    variables, calls = fed.variables, fed.calls
    batch_G = {k: v[0] for k, v in calls[0].items()}
    fns = grad_fns(wl.legacy_model(), sharding.make_mesh(devices))
    grads = {name: convert.flatten(f(variables['params'], batch_G)) for name, f in fns.items()}
    ref = grads.pop('reference')
    ratio = {k: float(np.linalg.norm(grads['wrong'][k]) / np.linalg.norm(ref[k])) for k in ref}
    fixes = {name: g for name, g in grads.items() if name != 'wrong'}
    return CaseResult(
        symptom=f'|grad| / |reference grad| = {min(ratio.values()):.3f} to {max(ratio.values()):.3f} '
        f'on {devices} devices (max |diff| {max_abs_diff(ref, grads["wrong"]):.1e})',
        threshold='gradient norm ratio within 1% of D, and outside tolerance',
        damage_shown=all(abs(r - devices) < 0.01 * devices for r in ratio.values())
        and not within_tol(ref, grads['wrong']),
        fix='; '.join(
            f'{name}: max |diff| {max_abs_diff(ref, g):.1e} ok {yes(within_tol(ref, g))}' for name, g in fixes.items()
        ),
        fix_matches=all(within_tol(ref, g) for g in fixes.values()),
        details={
            'grad_norm_ratio': ratio,
            'wrong_max_abs': max_abs_diff(ref, grads['wrong']),
            **{name: max_abs_diff(ref, g) for name, g in fixes.items()},
        },
    )
