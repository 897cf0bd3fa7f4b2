"""A new user's pmap trainer (issue 60): biased convs before ``BatchNorm(axis_name='batch')``, LayerNorm,
dropout, ``optax.chain(clip_by_global_norm, adamw(warmup_cosine_decay_schedule))``, label smoothing, a flax
``TrainState`` and ``jax.pmap(train_step)``; its NNX port, and slips of its warmup and its clip. The conv
biases' gradient is zero up to rounding (BatchNorm takes the mean out), so they and their Adam slots are
noise-dominated: they must not hide the update rule that every other leaf shows (``test_where``)."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from equivalence import LoopPort

CLASSES, AXIS = 10, 'batch'


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        for i, (width, stride) in enumerate(((8, 1), (16, 2))):
            x = nn.Conv(width, (3, 3), strides=(stride, stride), name=f'conv{i + 1}')(x)  # biased, before BN
            x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=AXIS, name=f'bn{i + 1}')(x))
        x = nn.LayerNorm(name='ln')(nn.Dense(32, name='fc1')(jnp.mean(x, axis=(1, 2))))
        return nn.Dense(CLASSES, name='head')(nn.Dropout(0.1, deterministic=not train)(nn.gelu(x)))


class NnxNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1, self.bn1 = nnx.Conv(3, 8, (3, 3), rngs=rngs), nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), strides=(2, 2), rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.fc1, self.ln = nnx.Linear(16, 32, rngs=rngs), nnx.LayerNorm(32, rngs=rngs)
        self.drop, self.head = nnx.Dropout(0.1, rngs=rngs), nnx.Linear(32, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn2(self.conv2(nnx.relu(self.bn1(self.conv1(x))))))
        return self.head(self.drop(nnx.gelu(self.ln(self.fc1(jnp.mean(x, axis=(1, 2)))))))


def make_tx(warmup: int = 3, clip: float = 1.0) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup, 50)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=1e-4))


class TrainState(train_state.TrainState):
    batch_stats: Any


def loss_of(logits, labels):
    return jnp.mean(optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(labels, CLASSES), 0.1)))


def train_step(state, batch, rng):
    """The user's step, as ``jax.pmap(train_step, axis_name='batch')`` runs it."""

    def loss_fn(params):
        logits, new = state.apply_fn({'params': params, 'batch_stats': state.batch_stats}, batch['image'],
                                     mutable=['batch_stats'], rngs={'dropout': rng})  # fmt: skip
        return loss_of(logits, batch['label']), new

    (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=jax.lax.pmean(grads, AXIS), batch_stats=new['batch_stats'])
    return state, {'loss': jax.lax.pmean(loss, AXIS)}


@nnx.jit
def nnx_step(model, optimizer, batch, key):
    nnx.reseed(model, dropout=key)
    loss, grads = nnx.value_and_grad(lambda m: loss_of(m(batch['image']), batch['label']))(model)
    optimizer.update(model, grads)
    return {'loss': loss}


def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict:
    label = rng.integers(0, CLASSES, size=(n_steps, batch))
    image = rng.normal(size=(CLASSES, 1, 1, 3))[label] + rng.normal(size=(n_steps, batch, 8, 8, 3))
    return {'image': image.astype(np.float32), 'label': label.astype(np.int32)}


def port(name: str, **new_tx) -> LoopPort:
    create = lambda v: TrainState.create(apply_fn=LinenNet().apply, params=v['params'], tx=make_tx(),  # noqa: E731
                                         batch_stats=v['batch_stats'])  # fmt: skip
    return LoopPort(
        name=name, legacy_model=LinenNet, nnx_model=lambda rngs: NnxNet(rngs=rngs), make_data=make_data,
        legacy_state=create, legacy_step=train_step, step_form='state_rng', loss='loss',
        new_state=lambda model: (model, nnx.Optimizer(model, make_tx(**new_tx), wrt=nnx.Param)),
        new_step=lambda ts, batch, key: nnx_step(*ts, batch, key), init_args=lambda batch: (batch['image'], False),
        names='structure', rng_modes=('global',), default_batch=16,
    )  # fmt: skip
