"""A team's pmap-era image classifier, the model they would rather not rewrite (not part of the suite).

A small vision transformer in linen, standing in for a large one: a patch embedding (a strided
``nn.Conv``), a ``LayerNorm``, self-attention with attention dropout
(``nn.MultiHeadDotProductAttention(dropout_rate=...)``), an MLP block with ``nn.Dropout``, a mean
pool and a ``Dense`` head; every submodule auto-named (``Conv_0``, ``Block_0/...``). Trained as
flax's examples train: a ``train_state.TrainState`` with optax AdamW and a warmup-cosine schedule,
``train_step(state, batch, dropout_rng)`` under ``jax.pmap(train_step, axis_name='batch')``, the key
handed to ``apply(rngs={'dropout': dropout_rng})``, the gradients and metrics ``pmean``'d.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

IMAGE, PATCH, CLASSES = (8, 8, 1), 2, 10
WIDTH, HEADS, MLP, DROPOUT, ATTENTION_DROPOUT = 16, 2, 32, 0.1, 0.1
LEARNING_RATE, WARMUP, DECAY_STEPS, WEIGHT_DECAY = 3e-3, 2, 40, 1e-4


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        y = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=ATTENTION_DROPOUT,
                                            deterministic=not train)(nn.LayerNorm()(x))  # fmt: skip
        x = x + y
        y = nn.Dense(MLP)(nn.LayerNorm()(x))
        y = nn.Dropout(DROPOUT, deterministic=not train)(nn.gelu(y))
        return x + nn.Dense(WIDTH)(y)


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, image, train: bool):
        x = nn.Conv(WIDTH, (PATCH, PATCH), strides=(PATCH, PATCH), padding='VALID')(image)
        x = x.reshape(x.shape[0], -1, WIDTH)  # [B, patches, WIDTH]
        x = nn.Dropout(DROPOUT, deterministic=not train)(x)
        x = Block()(x, train)
        return nn.Dense(CLASSES)(jnp.mean(nn.LayerNorm()(x), axis=1))


learning_rate_fn = optax.warmup_cosine_decay_schedule(0.0, LEARNING_RATE, WARMUP, DECAY_STEPS)


def create_train_state(params) -> train_state.TrainState:
    tx = optax.adamw(learning_rate_fn, weight_decay=WEIGHT_DECAY)
    return train_state.TrainState.create(apply_fn=Classifier().apply, params=params, tx=tx)


def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict:
    """``{'image': [n_steps, batch, 8, 8, 1], 'label': [n_steps, batch]}``: a noisy random linear teacher."""
    w = rng.normal(size=(int(np.prod(IMAGE)), CLASSES))
    image = rng.normal(size=(n_steps, batch, *IMAGE)).astype(np.float32)
    logits = image.reshape(n_steps, batch, -1) @ w + rng.normal(size=(n_steps, batch, CLASSES))
    return {'image': image, 'label': np.argmax(logits, -1).astype(np.int32)}


def train_step(state: train_state.TrainState, batch, dropout_rng):
    """One step on one device; ``dropout_rng`` is this step's key, as the host loop hands it."""

    def loss_fn(params):
        logits = state.apply_fn({'params': params}, batch['image'], train=True, rngs={'dropout': dropout_rng})
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()
        return loss, logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads = jax.lax.pmean(grads, axis_name='batch')
    state = state.apply_gradients(grads=grads)
    metrics = {'loss': loss, 'accuracy': jnp.mean(jnp.argmax(logits, -1) == batch['label'])}
    return state, jax.lax.pmean(metrics, axis_name='batch')


p_train_step = jax.pmap(train_step, axis_name='batch', donate_argnums=(0,))
