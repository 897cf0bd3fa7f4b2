"""The fastest migration: the linen classifier kept as it is, wrapped by ``nnx.bridge.ToNNX`` and
trained in NNX (not part of the suite).

``bridge.lazy_init`` builds its variables from one sample image; ``nnx.Optimizer(model, tx,
wrt=nnx.Param)`` holds the same optax AdamW; ``train_step`` is one ``nnx.jit`` step over the wrapped
model and its optimizer, with no ``pmean``: the loss is the mean over the global batch.

The key rule of the bridge: ``ToNNX.__call__`` hands linen ``{name: stream()}`` of an ``nnx.Rngs``
(``fold_in(key, count)``: not the key) and a plain key array as ``{'params': key}``, which linen's
``make_rng('dropout')`` falls back to. So ``rngs=nnx.Rngs(dropout=dropout_rng)``, or the model's own
stream reseeded with it, hands linen another key than the pmap step's ``apply(rngs={'dropout': ...})``
(``train_step_reseeded``, the slip). ``train_step`` hands it the key itself through ``KeyRngs``;
``train_step_raw_key`` hands the key array (the same masks, by linen's 'params' fallback).
"""

import jax.numpy as jnp
import legacy_code as old
import optax
from flax import nnx
from flax.nnx import bridge


def create_model(rngs: nnx.Rngs) -> bridge.ToNNX:
    """The linen classifier, unchanged, as an NNX module: its variables built from one sample image."""
    model = bridge.ToNNX(old.Classifier(), rngs=rngs)
    return bridge.lazy_init(model, jnp.zeros((1, *old.IMAGE)), train=False)


def create_optimizer(model: bridge.ToNNX) -> nnx.Optimizer:
    return nnx.Optimizer(model, optax.adamw(old.learning_rate_fn, weight_decay=old.WEIGHT_DECAY), wrt=nnx.Param)


def loss_and_metrics(model: bridge.ToNNX, batch, rngs):
    def loss_fn(model):
        logits = model(batch['image'], train=True, rngs=rngs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean(), logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return grads, {'loss': loss, 'accuracy': jnp.mean(jnp.argmax(logits, -1) == batch['label'])}


class KeyRngs(nnx.Rngs):
    """An ``nnx.Rngs`` whose streams hand ``ToNNX`` their key itself, not ``fold_in(key, count)``:
    ``ToNNX.__call__`` calls ``stream()`` for each of ``rngs.items()``."""

    def items(self):
        for name, stream in super().items():
            yield name, lambda stream=stream: stream.key[...]


@nnx.jit
def train_step(model: bridge.ToNNX, optimizer: nnx.Optimizer, batch, dropout_rng):
    """One step on the global batch; linen gets ``dropout_rng`` itself, as ``apply(rngs={'dropout': ...})``."""
    grads, metrics = loss_and_metrics(model, batch, KeyRngs(dropout=dropout_rng))
    optimizer.update(model, grads)
    return metrics


@nnx.jit
def train_step_raw_key(model: bridge.ToNNX, optimizer: nnx.Optimizer, batch, dropout_rng):
    """The same, the key array handed as it is: linen gets ``{'params': dropout_rng}``, and its
    ``make_rng('dropout')`` falls back to that key."""
    grads, metrics = loss_and_metrics(model, batch, dropout_rng)
    optimizer.update(model, grads)
    return metrics


@nnx.jit
def train_step_reseeded(model: bridge.ToNNX, optimizer: nnx.Optimizer, batch, dropout_rng):
    """The step written as native NNX code is: the model's own ``dropout`` stream reseeded with this
    step's key, then the model called without ``rngs``. Linen gets ``fold_in`` of the stream's key."""
    nnx.reseed(model, dropout=dropout_rng)
    grads, metrics = loss_and_metrics(model, batch, None)
    optimizer.update(model, grads)
    return metrics
