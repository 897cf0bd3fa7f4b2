"""A team's pmap-era language model, written as flax's linen ``examples/lm1b`` was: token
embeddings, an MLP and dropout 0.1, label smoothing, padded targets with token weights,
``dropout_rng = fold_in(dropout_rng, state.step)``, a metrics dict psum'd over devices, and
``jax.pmap(train_step, axis_name='batch')`` called once per step. Shrunk to a next-token model on
packed rows of 6 tokens (padded to 8) so that it trains on a CPU in seconds. Not part of the suite.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import common_utils, train_state

VOCAB, LENGTH, REAL, EMB, MLP, DROPOUT = 16, 8, 6, 16, 32, 0.1
LEARNING_RATE, WARMUP_STEPS, LABEL_SMOOTHING = 0.05, 4, 0.1


def shift_right(x):
    return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


class LanguageModel(nn.Module):
    @nn.compact
    def __call__(self, inputs, train: bool = True):
        y = nn.Embed(VOCAB, EMB)(shift_right(inputs))
        y = nn.Dropout(rate=DROPOUT)(y, deterministic=not train)
        y = nn.relu(nn.Dense(MLP)(nn.LayerNorm()(y)))
        y = nn.Dropout(rate=DROPOUT)(y, deterministic=not train)
        return nn.Dense(VOCAB)(y)


def create_learning_rate_schedule(learning_rate: float, warmup_steps: int):
    """lm1b's rsqrt schedule with linear warmup."""

    def step_fn(step):
        return learning_rate * jnp.minimum(1.0, step / warmup_steps) / jnp.sqrt(jnp.maximum(step, warmup_steps))

    return step_fn


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(confidence * jnp.log(confidence) + (vocab_size - 1) * low_confidence * jnp.log(
        low_confidence + 1e-20))  # fmt: skip
    soft_targets = common_utils.onehot(targets, vocab_size, on_value=confidence, off_value=low_confidence)
    loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant
    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def compute_metrics(logits, labels, weights, label_smoothing=0.0):
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
    acc = jnp.sum(jnp.equal(jnp.argmax(logits, axis=-1), labels) * weights)
    metrics = {'loss': loss, 'accuracy': acc, 'denominator': weight_sum}
    return jax.lax.psum(metrics, axis_name='batch')


def train_step(state, batch, learning_rate_fn, label_smoothing=0.0, dropout_rng=None):
    """Perform a single training step."""
    inputs = batch['inputs']
    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = LanguageModel().apply({'params': params}, inputs, train=True, rngs={'dropout': dropout_rng})
        loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights, label_smoothing)
        return loss / weight_sum, logits

    lr = learning_rate_fn(state.step)
    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads = jax.lax.pmean(grads, axis_name='batch')
    new_state = state.apply_gradients(grads=grads)
    metrics = compute_metrics(logits, inputs, weights)
    metrics['learning_rate'] = lr
    return new_state, metrics


learning_rate_fn = create_learning_rate_schedule(LEARNING_RATE, WARMUP_STEPS)


def create_train_state(params) -> train_state.TrainState:
    tx = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0)
    return train_state.TrainState.create(apply_fn=LanguageModel().apply, params=params, tx=tx)


def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict:
    """``{'inputs': [n_steps, batch, 8]}``: packed rows of 6 tokens of a noisy counting language
    (tokens 1..15), then padding zeros. Packed, as lm1b packs its examples: every device holds as
    many real tokens, so the pmap step's per-device token means average to the global one."""
    lengths = np.full((n_steps, batch), REAL)
    start = rng.integers(1, VOCAB, size=(n_steps, batch, 1))
    tokens = (start + np.arange(LENGTH)) % (VOCAB - 1) + 1
    tokens = np.where(rng.random(tokens.shape) < 0.1, rng.integers(1, VOCAB, size=tokens.shape), tokens)
    return {'inputs': np.where(np.arange(LENGTH) < lengths[..., None], tokens, 0).astype(np.int32)}


p_train_step = jax.pmap(functools.partial(train_step, learning_rate_fn=learning_rate_fn,
                                          label_smoothing=LABEL_SMOOTHING), axis_name='batch')  # fmt: skip
