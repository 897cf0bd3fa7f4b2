"""A benchmark workload as it was before its migration: a linen classifier trained with
``jax.pmap(train_step, axis_name='batch')`` over a plain tuple ``(params, opt_state)``, the
gradients ``lax.pmean``'d, Adam behind a linear warmup, called once per step. The model, the
data and the optimizer stay as they are in the migration (``jit_code.py`` imports them). Not part
of the suite.
"""

import flax.linen as nn
import jax
import numpy as np
import optax

FEATURES, HIDDEN, CLASSES = 16, 32, 4
LEARNING_RATE, WARMUP_STEPS = 0.01, 4


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(HIDDEN)(x))
        h = nn.relu(nn.Dense(HIDDEN)(h))
        return nn.Dense(CLASSES)(h)


def make_tx(warmup_steps: int = WARMUP_STEPS) -> optax.GradientTransformation:
    schedule = optax.linear_schedule(0.0, LEARNING_RATE, warmup_steps)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))


def loss_fn(params, batch):
    logits = Classifier().apply({'params': params}, batch['x'])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y']).mean()


tx = make_tx()


def init_optimizer_state(params):
    return params, tx.init(params)


def train_step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    grads = jax.lax.pmean(grads, axis_name='batch')
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {'loss': jax.lax.pmean(loss, axis_name='batch')}


p_train_step = jax.pmap(train_step, axis_name='batch')


def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict:
    """``{'x': [n_steps, batch, 16], 'y': [n_steps, batch]}``: the label is the argmax of a fixed
    random projection of x."""
    x = rng.normal(size=(n_steps, batch, FEATURES)).astype(np.float32)
    w = np.random.default_rng(123).normal(size=(FEATURES, CLASSES)).astype(np.float32)
    return {'x': x, 'y': np.argmax(x @ w, axis=-1).astype(np.int32)}
