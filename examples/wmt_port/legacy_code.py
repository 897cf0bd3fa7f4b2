"""A team's pmap-era translation Transformer, written as flax's ``examples/wmt/train.py`` was
(linen era): attention and MLP dropout 0.1 (``broadcast_dropout=False``), label smoothing, padded
targets with token weights, ``dropout_rng = fold_in(dropout_rng, state.step)``, a metrics dict
psum'd over devices, ``jax.pmap(train_step, axis_name='batch')`` called once per step and an
Orbax ``CheckpointManager``. Shrunk to one decoder block on packed rows of 6 tokens (padded to
8), as wmt packs its examples, so that it trains on a CPU in seconds. Not part of the suite.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import common_utils, train_state

VOCAB, LENGTH, REAL, EMB, HEADS, MLP, DROPOUT = 16, 8, 6, 16, 2, 32, 0.1
LEARNING_RATE, WARMUP_STEPS, LABEL_SMOOTHING = 0.05, 4, 0.1


def shift_right(x):
    return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


class DecoderBlock(nn.Module):
    @nn.compact
    def __call__(self, y, mask, deterministic: bool):
        x = nn.LayerNorm()(y)
        x = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=EMB, use_bias=False,
                                            broadcast_dropout=False, dropout_rate=DROPOUT,
                                            deterministic=deterministic)(x, mask=mask)  # fmt: skip
        y = y + nn.Dropout(rate=DROPOUT)(x, deterministic=deterministic)
        z = nn.Dense(MLP)(nn.LayerNorm()(y))
        z = nn.Dense(EMB)(nn.Dropout(rate=DROPOUT)(nn.relu(z), deterministic=deterministic))
        return y + nn.Dropout(rate=DROPOUT)(z, deterministic=deterministic)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, targets, train: bool = True):
        mask = nn.combine_masks(nn.make_attention_mask(targets > 0, targets > 0), nn.make_causal_mask(targets))
        y = nn.Embed(VOCAB, EMB)(shift_right(targets))
        y = nn.Dropout(rate=DROPOUT)(y, deterministic=not train)
        y = DecoderBlock()(y, mask, deterministic=not train)
        return nn.Dense(VOCAB)(nn.LayerNorm()(y))


def create_learning_rate_schedule(learning_rate: float, warmup_steps: int):
    """wmt's rsqrt schedule with linear warmup."""

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


def compute_weighted_accuracy(logits, targets, weights=None):
    loss = jnp.equal(jnp.argmax(logits, axis=-1), targets)
    normalizing_factor = np.prod(logits.shape[:-1])
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def compute_metrics(logits, labels, weights, label_smoothing=0.0):
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
    acc, _ = compute_weighted_accuracy(logits, labels, weights)
    metrics = {'loss': loss, 'accuracy': acc, 'denominator': weight_sum}
    return jax.lax.psum(metrics, axis_name='batch')


def train_step(state, batch, learning_rate_fn, label_smoothing=0.0, dropout_rng=None):
    """Perform a single training step."""
    targets = batch['targets']
    weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = Decoder().apply({'params': params}, targets, train=True, rngs={'dropout': dropout_rng})
        loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights, label_smoothing)
        return loss / weight_sum, logits

    step = state.step
    lr = learning_rate_fn(step)
    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads = jax.lax.pmean(grads, axis_name='batch')
    new_state = state.apply_gradients(grads=grads)
    metrics = compute_metrics(logits, targets, weights)
    metrics['learning_rate'] = lr
    return new_state, metrics


learning_rate_fn = create_learning_rate_schedule(LEARNING_RATE, WARMUP_STEPS)


def create_train_state(params) -> train_state.TrainState:
    tx = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0)
    return train_state.TrainState.create(apply_fn=Decoder().apply, params=params, tx=tx)


def make_data(rng: np.random.Generator, n_steps: int, batch: int, real: int = REAL) -> dict:
    """``{'targets': [n_steps, batch, 8]}``: packed rows of ``real`` tokens (a noisy counting
    language, tokens 1..15), then padding zeros; ``real=None``: each row its own length."""
    lengths = np.full((n_steps, batch), real) if real else rng.integers(2, LENGTH + 1, size=(n_steps, batch))
    start = rng.integers(1, VOCAB, size=(n_steps, batch, 1))
    tokens = (start + np.arange(LENGTH)) % (VOCAB - 1) + 1
    tokens = np.where(rng.random(tokens.shape) < 0.1, rng.integers(1, VOCAB, size=tokens.shape), tokens)
    return {'targets': np.where(np.arange(LENGTH) < lengths[..., None], tokens, 0).astype(np.int32)}


def make_checkpoint_manager(workdir: str) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(workdir, options=ocp.CheckpointManagerOptions(max_to_keep=3, create=True))


def save_checkpoint(manager: ocp.CheckpointManager, state) -> None:
    """Replica 0 of the replicated state, on the host, through the team's own CheckpointManager."""
    state = jax.device_get(jax.tree_util.tree_map(lambda x: x[0], state))
    manager.save(int(state.step), args=ocp.args.StandardSave(state))
    manager.wait_until_finished()


p_train_step = jax.pmap(functools.partial(train_step, learning_rate_fn=learning_rate_fn,
                                          label_smoothing=LABEL_SMOOTHING), axis_name='batch')  # fmt: skip
