"""The Transformer of ``transformer.py`` at level 2: the team's own pmap step and NNX call.

An optimizer slip needs this level: a model port trains both sides with one ``make_tx``, a
loop port brings each side's optimizer in its own loop. The loops are written as the
example port's are (``examples/mlp_port``): score_sde's step with an explicit ``lax.pmean``,
and ``nnx.jit(nnx.scan)`` over the model and optimizer, dropout reseeded from the step key.
"""

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from equivalence import LoopPort
from equivalence.corpus import transformer as tf
from equivalence.corpus.entry import Entry

AXIS = 'batch'


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def linen_state(variables: dict) -> TrainState:
    params = variables['params']
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tf.make_tx().init(params))


def linen_step(carry, batch):
    """One step on one device; the gradient averaged over devices with pmean."""
    rng, state = carry
    rng, step_rng = jax.random.split(rng)

    def loss_fn(params):
        logits = tf.LinenEncoder().apply({'params': params}, batch['x'], train=True, rngs={'dropout': step_rng})
        return jnp.mean(tf.token_losses(logits, batch['y'], tf.LABEL_SMOOTHING))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = jax.lax.pmean(grads, axis_name=AXIS)
    updates, opt_state = tf.make_tx().update(grads, state.opt_state, state.params)
    state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
    return (rng, state), jax.lax.pmean(loss, axis_name=AXIS)


@nnx.jit
def train_calls(model: tf.NnxEncoder, optimizer: nnx.Optimizer, key: jax.Array, batch_KxG):
    """K steps in one compiled call; each step's loss."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def step(carry, batch):
        model, optimizer, key = carry
        key, step_key = jax.random.split(key)
        nnx.reseed(model, dropout=step_key)
        loss_fn = lambda m: jnp.mean(tf.token_losses(m(batch['x']), batch['y'], tf.LABEL_SMOOTHING))  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return (model, optimizer, key), loss

    _, losses_K = step((model, optimizer, key), batch_KxG)
    return losses_K


def nnx_call(train_state, key, batch_KxG):
    model, optimizer = train_state
    return train_state, train_calls(model, optimizer, key, batch_KxG)


def nnx_state(tx: optax.GradientTransformation):
    return lambda model: (model, nnx.Optimizer(model, tx, wrt=nnx.Param))


LOOP = LoopPort(
    name='transformer-loop',
    legacy_model=tf.LinenEncoder,
    nnx_model=lambda rngs: tf.NnxEncoder(rngs=rngs),
    make_data=tf.make_data,
    legacy_state=linen_state,
    legacy_step=linen_step,
    new_state=nnx_state(tf.make_tx()),
    new_call=nnx_call,
    init_args=lambda batch: (batch['x'], False),
    axis_name=AXIS,
    names=tf.NAMES,
    default_batch=32,
    rng_modes=('global',),  # the NNX loop takes one key per call
    summary='the transformer at level 2: own pmap step, own nnx.jit(nnx.scan)',
)


def optimizer_slip(name: str, tx: optax.GradientTransformation) -> LoopPort:
    """The loop port whose NNX side builds its optimizer as ``tx``; linen keeps ``make_tx()``."""
    return dataclasses.replace(LOOP, name=name, new_state=nnx_state(tx))


ADAM_EPS_SLIP = optimizer_slip('tf-adam-eps', tf.make_tx(eps=1e-8))  # optax's default, not the linen side's 1e-9
WEIGHT_DECAY_SLIP = optimizer_slip('tf-weight-decay', tf.make_tx(weight_decay=0.0))  # AdamW's decay left out

ENTRIES = [
    Entry('transformer-loop', 'correct', LOOP, 'the transformer in its own pmap step and nnx.jit(nnx.scan) loop'),
    Entry('tf-adam-eps', 'slip', ADAM_EPS_SLIP, 'NNX AdamW eps 1e-8 (optax default), linen 1e-9', kind='optimizer'),
    Entry('tf-weight-decay', 'slip', WEIGHT_DECAY_SLIP, 'NNX AdamW weight_decay 0, linen 1e-2', kind='optimizer'),
]
