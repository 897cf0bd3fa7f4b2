"""The example's loop port (``examples/mlp_port``) under AdamW with a warmup, each side's optimizer its own
(issue 61): ``CORRECT``, both decaying every leaf; ``MASKED``, the new side decaying only its >= 2-D leaves,
as a blind port of real code did where upstream decays them all. At a warmup's learning rate that weight
decay moves each step by less than one step's floor: a MATCH before the trends were read."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import optax
from conftest import ROOT
from flax import nnx

sys.path.insert(0, os.path.join(ROOT, 'examples', 'mlp_port'))
import legacy_code as old  # noqa: E402
import my_port  # noqa: E402


def adamw(masked: bool = False, decay: float = 1e-4):
    kernels = (lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)) if masked else None
    return optax.adamw(optax.linear_schedule(0.0, 3e-3, 10), weight_decay=decay, mask=kernels)


def pmap_step(tx):
    def train_step(carry, batch):
        rng, state = carry
        rng, step_rng = jax.random.split(rng)
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(old.per_example_loss(p, batch, step_rng)))(state.params)
        updates, opt_state = tx.update(jax.lax.pmean(grads, old.AXIS), state.opt_state, state.params)
        state = state.replace(
            step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state
        )
        return (rng, state), jax.lax.pmean(loss, old.AXIS)

    return train_step


def port(name: str, new_tx) -> object:
    tx = adamw()
    legacy_state = lambda v: old.TrainState(step=jnp.zeros((), jnp.int32), params=v['params'],  # noqa: E731
                                            opt_state=tx.init(v['params']))  # fmt: skip
    return dataclasses.replace(
        my_port.LOOP, name=name, legacy_state=legacy_state, legacy_step=pmap_step(tx),
        new_state=lambda model: (model, nnx.Optimizer(model, new_tx, wrt=nnx.Param)),
    )  # fmt: skip


CORRECT = port('decay-correct', adamw())
MASKED = port('decay-masked', adamw(masked=True))
