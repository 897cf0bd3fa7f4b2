"""A team's pmap-era image classifier, written as flax's ``examples/imagenet/train.py`` was
(linen era): a ResNet with ``nn.BatchNorm(axis_name='batch')``, SGD with nesterov momentum on a
warmup + cosine schedule, weight decay in the loss, a ``TrainState`` subclass holding
``batch_stats`` and ``dynamic_scale``, and ``jax.pmap(train_step, axis_name='batch')`` called
once per step. Shrunk to 8x8 images and one residual block, so that it trains on a CPU in
seconds. Not part of the suite.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import checkpoints, common_utils, train_state
from flax.training import dynamic_scale as dynamic_scale_lib
from jax import lax

NUM_CLASSES, IMAGE_SIZE = 10, 8
MOMENTUM, BASE_LR, WARMUP_STEPS, TOTAL_STEPS = 0.9, 0.1, 2, 20


class ResNetBlock(nn.Module):
    filters: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                                 axis_name='batch')  # fmt: skip
        residual = x
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), use_bias=False)(x)))
        y = norm(scale_init=nn.initializers.zeros)(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        return nn.relu(residual + y)


class ResNet(nn.Module):
    num_filters: int = 8

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.num_filters, (3, 3), use_bias=False, name='conv_init')(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, axis_name='batch',
                         name='bn_init')(x)  # fmt: skip
        x = ResNetBlock(self.num_filters)(nn.relu(x), train)
        return nn.Dense(NUM_CLASSES)(jnp.mean(x, axis=(1, 2)))


def cross_entropy_loss(logits, labels):
    one_hot_labels = common_utils.onehot(labels, num_classes=NUM_CLASSES)
    return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels))


def compute_metrics(logits, labels):
    loss = cross_entropy_loss(logits, labels)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return lax.pmean({'loss': loss, 'accuracy': accuracy}, axis_name='batch')


def create_learning_rate_fn():
    warmup_fn = optax.linear_schedule(init_value=0.0, end_value=BASE_LR, transition_steps=WARMUP_STEPS)
    cosine_fn = optax.cosine_decay_schedule(init_value=BASE_LR, decay_steps=TOTAL_STEPS - WARMUP_STEPS)
    return optax.join_schedules(schedules=[warmup_fn, cosine_fn], boundaries=[WARMUP_STEPS])


learning_rate_fn = create_learning_rate_fn()


def train_step(state, batch, learning_rate_fn):
    """Perform a single training step."""

    def loss_fn(params):
        logits, new_model_state = state.apply_fn({'params': params, 'batch_stats': state.batch_stats},
                                                 batch['image'], mutable=['batch_stats'])  # fmt: skip
        loss = cross_entropy_loss(logits, batch['label'])
        weight_penalty_params = jax.tree_util.tree_leaves(params)
        weight_decay = 0.0001
        weight_l2 = sum(jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1)
        weight_penalty = weight_decay * 0.5 * weight_l2
        return loss + weight_penalty, (new_model_state, logits)

    step = state.step
    dynamic_scale = state.dynamic_scale
    lr = learning_rate_fn(step)
    if dynamic_scale:
        grad_fn = dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name='batch')
        dynamic_scale, is_fin, aux, grads = grad_fn(state.params)  # dynamic_scale pmeans the gradients
    else:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        aux, grads = grad_fn(state.params)
        grads = lax.pmean(grads, axis_name='batch')
    new_model_state, logits = aux[1]
    metrics = compute_metrics(logits, batch['label'])
    metrics['learning_rate'] = lr
    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state['batch_stats'])
    if dynamic_scale:  # if is_fin == False the gradients contain Inf/NaNs: keep the old state
        new_state = new_state.replace(
            opt_state=jax.tree_util.tree_map(functools.partial(jnp.where, is_fin), new_state.opt_state,
                                             state.opt_state),
            params=jax.tree_util.tree_map(functools.partial(jnp.where, is_fin), new_state.params, state.params),
            dynamic_scale=dynamic_scale,
        )  # fmt: skip
        metrics['scale'] = dynamic_scale.scale
    return new_state, metrics


class TrainState(train_state.TrainState):
    batch_stats: Any
    dynamic_scale: dynamic_scale_lib.DynamicScale


def create_train_state(params, batch_stats, half_precision: bool = True) -> TrainState:
    """The flax example's ``create_train_state``, from already initialised variables."""
    dynamic_scale = dynamic_scale_lib.DynamicScale() if half_precision else None
    tx = optax.sgd(learning_rate=learning_rate_fn, momentum=MOMENTUM, nesterov=True)
    return TrainState.create(apply_fn=ResNet().apply, params=params, tx=tx, batch_stats=batch_stats,
                             dynamic_scale=dynamic_scale)  # fmt: skip


def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict:
    """``{'image': [n_steps, batch, 8, 8, 3], 'label': [n_steps, batch]}``: class-dependent blobs."""
    label = rng.integers(0, NUM_CLASSES, size=(n_steps, batch))
    means = rng.normal(size=(NUM_CLASSES, 1, 1, 3))
    image = means[label] + rng.normal(size=(n_steps, batch, IMAGE_SIZE, IMAGE_SIZE, 3))
    return {'image': image.astype(np.float32), 'label': label.astype(np.int32)}


def save_checkpoint(state, workdir):
    """The example's saver: replica 0 on the host, flax's Orbax-backed ``checkpoint_<step>``."""
    state = jax.device_get(jax.tree_util.tree_map(lambda x: x[0], state))
    checkpoints.save_checkpoint(workdir, state, int(state.step), keep=3)


p_train_step = jax.pmap(functools.partial(train_step, learning_rate_fn=learning_rate_fn), axis_name='batch')
