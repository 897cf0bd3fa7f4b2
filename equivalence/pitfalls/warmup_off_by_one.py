"""Pitfall 11: learning-rate warmup off by one step.

score_sde's ``optimize_fn`` sets ``lr * min(step / warmup, 1)`` from the train state's
``step`` *before* it is incremented, so the first update has learning rate 0 and the
last warmup step reaches ``lr * (warmup - 1) / warmup``. A port that counts the update
being made (``count + 1``: the PyTorch habit, or ``nnx.Optimizer.step`` read after the
update) is one step ahead for the whole warmup: the first update already moves the
parameters. optax evaluates a schedule at the count before its increment, so the
suite's ``score_tx`` (``lr * min(count / warmup, 1)``) and ``optax.linear_schedule(0, lr,
warmup)`` both match. The reference is score_sde's update written out with
``flax.optim.Adam``'s formulas, with no optax in it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from equivalence.core.port import workloads
from equivalence.core.state import convert
from equivalence.pitfalls.base import DAMAGE, CaseResult, max_abs_diff, within_tol, yes
from legacy_pmap import losses as legacy_losses

NUMBER = 11
NAME = 'warmup_off_by_one'
TITLE = 'learning-rate warmup off by one'
DESCRIPTION = (
    "score_sde's warmup lr * min(step / warmup, 1) reads the step count before the increment: its first update "
    'has learning rate 0. A schedule ported as lr * min((count + 1) / warmup, 1) is a step ahead through the warmup.'
)
LR, WARMUP, CLIP, STEPS = 2e-3, 10, 1.0, 20
B1, B2, EPS = 0.9, 0.999, 1e-8


def reference_update(params, grads, adam: tuple, step):
    """score_sde's optimize_fn with flax.optim.Adam: clip by global norm, then Adam at lr(step before +1)."""
    lr = LR * jnp.minimum(step / WARMUP, 1.0)
    norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: g * CLIP / jnp.maximum(norm, CLIP), grads)
    mu = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, adam[0], grads)
    nu = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g**2, adam[1], grads)
    t = (step + 1).astype(jnp.float32)
    new = jax.tree.map(lambda p, m, v: p - lr * (m / (1 - B1**t)) / (jnp.sqrt(v / (1 - B2**t)) + EPS), params, mu, nu)
    return new, (mu, nu)


def optax_txs() -> dict[str, optax.GradientTransformation]:
    naive = lambda count: LR * jnp.minimum((count + 1) / WARMUP, 1.0)  # noqa: E731
    chain = lambda schedule: optax.chain(optax.clip_by_global_norm(CLIP), optax.adam(schedule, B1, B2, EPS))  # noqa: E731
    return {
        'naive (count + 1)': chain(naive),
        'suite score_tx': workloads.score_tx(1.0, lr=LR, warmup=WARMUP, clip=CLIP),
        'optax.linear_schedule(0, lr, warmup)': chain(optax.linear_schedule(0.0, LR, WARMUP)),
    }


def trajectory(update, init_opt, params, batches: dict, loss_fn) -> list[dict[str, np.ndarray]]:
    """Parameters after each of the steps, from one scanned jit call."""

    def step(carry, batch):
        params, opt, i = carry
        params, opt = update(params, jax.grad(loss_fn)(params, batch), opt, i)
        return (params, opt, i + 1), params

    _, params_N = jax.jit(lambda c, b: jax.lax.scan(step, c, b))((params, init_opt, jnp.int32(0)), batches)
    return [convert.flatten(jax.tree.map(lambda x, n=n: x[n], params_N)) for n in range(len(batches['x']))]


def optax_update(tx):
    def update(params, grads, opt, _):
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    return update


def run(devices: int) -> CaseResult:
    del devices  # a schedule, not a parallelism: one device
    wl = workloads.get('mlp')
    batches = wl.make_data(np.random.default_rng(0), STEPS, wl.default_batch)
    model = wl.legacy_model()
    params = model.init(jax.random.PRNGKey(0), batches['x'][0, :1])['params']
    loss_fn = lambda p, b: jnp.mean(legacy_losses.mlp_loss(model, p, {}, b, {})[0])  # noqa: E731
    zeros = jax.tree.map(jnp.zeros_like, params)
    ref = trajectory(reference_update, (zeros, zeros), params, batches, loss_fn)
    runs = {
        name: trajectory(optax_update(tx), tx.init(params), params, batches, loss_fn)
        for name, tx in optax_txs().items()
    }
    start = convert.flatten(params)
    first = {name: max_abs_diff(start, traj[0]) for name, traj in runs.items()}
    final = {name: max_abs_diff(ref[-1], traj[-1]) for name, traj in runs.items()}
    wrong = 'naive (count + 1)'
    ok = {name: all(within_tol(r, t) for r, t in zip(ref, traj, strict=True)) for name, traj in runs.items()}
    fixes = [name for name in runs if name != wrong]
    return CaseResult(
        symptom=f'first update moves params by {first[wrong]:.1e} (score_sde: {max_abs_diff(start, ref[0]):.0e}); '
        f'after {STEPS} steps (warmup {WARMUP}) params {final[wrong]:.1e} from the reference',
        threshold=f'first update and final parameter difference > {DAMAGE:g}',
        damage_shown=first[wrong] > DAMAGE and final[wrong] > DAMAGE,
        fix='; '.join(f'{n}: first update {first[n]:.0e}, final {final[n]:.1e}, ok {yes(ok[n])}' for n in fixes),
        fix_matches=all(ok[n] for n in fixes) and not ok[wrong],
        details={
            'lr': LR,
            'warmup': WARMUP,
            'steps': STEPS,
            'reference_first_update': max_abs_diff(start, ref[0]),
            'first_update': first,
            'final_max_abs_to_reference': final,
            'every_step_within_tolerance': ok,
        },
    )
