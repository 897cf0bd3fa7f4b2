"""A team's pmap-era image classifier, written as flax's ``examples/imagenet/train.py`` was
(linen era): a ResNet with ``nn.BatchNorm(axis_name='batch')``, SGD with nesterov momentum on a
warmup + cosine schedule, weight decay in the loss, a ``TrainState`` subclass holding
``batch_stats`` and ``dynamic_scale``, and ``jax.pmap(train_step, axis_name='batch')`` called
once per step. Its sizes are the model's fields, as flax's ``ResNet`` has them (``stage_sizes``,
``block_cls``, ``num_filters``, ``num_classes``): the defaults are shrunk to 8x8 images and one residual
block, so that it trains on a CPU in seconds; ``ResNet50`` is flax's, bottleneck blocks [3, 4, 6, 3]
and the 7x7/2 stem with its max pool (one field, ``imagenet_stem``, that flax's model has not: the
shrunk one's stem is a single 3x3 convolution). Not part of the suite.
"""

import functools
from collections.abc import Sequence
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


ModuleDef = Any


class ResNetBlock(nn.Module):
    """ResNet block."""

    filters: int
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv, norm = _conv_norm(train)
        residual = x
        y = nn.relu(norm()(conv(self.filters, (3, 3), self.strides)(x)))
        y = norm(scale_init=nn.initializers.zeros)(conv(self.filters, (3, 3))(y))
        if residual.shape != y.shape:
            residual = norm(name='norm_proj')(conv(self.filters, (1, 1), self.strides, name='conv_proj')(residual))
        return nn.relu(residual + y)


class BottleneckResNetBlock(nn.Module):
    """Bottleneck ResNet block."""

    filters: int
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv, norm = _conv_norm(train)
        residual = x
        y = nn.relu(norm()(conv(self.filters, (1, 1))(x)))
        y = nn.relu(norm()(conv(self.filters, (3, 3), self.strides)(y)))
        y = norm(scale_init=nn.initializers.zeros)(conv(self.filters * 4, (1, 1))(y))
        if residual.shape != y.shape:
            residual = conv(self.filters * 4, (1, 1), self.strides, name='conv_proj')(residual)
            residual = norm(name='norm_proj')(residual)
        return nn.relu(residual + y)


def _conv_norm(train: bool):
    """flax's ``conv`` (no bias: BatchNorm follows) and ``norm`` (statistics pmean'd over the devices)."""
    conv = functools.partial(nn.Conv, use_bias=False)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                             axis_name='batch')  # fmt: skip
    return conv, norm


class ResNet(nn.Module):
    """ResNetV1.5, as flax's: the defaults are the shrunk model (one block of 8 filters, 8x8 images)."""

    stage_sizes: Sequence[int] = (1,)
    block_cls: ModuleDef = ResNetBlock
    num_classes: int = NUM_CLASSES
    num_filters: int = 8
    imagenet_stem: bool = False  # flax's 7x7/2 convolution and 3x3/2 max pool; False: one 3x3 convolution

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv, norm = _conv_norm(train)
        if self.imagenet_stem:
            x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name='conv_init')(x)
        else:
            x = conv(self.num_filters, (3, 3), name='conv_init')(x)
        x = nn.relu(norm(name='bn_init')(x))
        if self.imagenet_stem:
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding='SAME')
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(self.num_filters * 2**i, strides=strides)(x, train)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


ResNet50 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3), block_cls=BottleneckResNetBlock, num_classes=1000,
                             num_filters=64, imagenet_stem=True)  # fmt: skip


def cross_entropy_loss(logits, labels):
    one_hot_labels = common_utils.onehot(labels, num_classes=logits.shape[-1])
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


def create_train_state(params, batch_stats, half_precision: bool = True, model: nn.Module | None = None) -> TrainState:
    """The flax example's ``create_train_state``, from already initialised variables (of ``model``: the
    shrunk ``ResNet()`` unless told)."""
    dynamic_scale = dynamic_scale_lib.DynamicScale() if half_precision else None
    tx = optax.sgd(learning_rate=learning_rate_fn, momentum=MOMENTUM, nesterov=True)
    return TrainState.create(apply_fn=(model or ResNet()).apply, params=params, tx=tx, batch_stats=batch_stats,
                             dynamic_scale=dynamic_scale)  # fmt: skip


def make_data(rng: np.random.Generator, n_steps: int, batch: int, image_size: int = IMAGE_SIZE,
              num_classes: int = NUM_CLASSES) -> dict:  # fmt: skip
    """``{'image': [n_steps, batch, S, S, 3], 'label': [n_steps, batch]}``: class-dependent blobs."""
    label = rng.integers(0, num_classes, size=(n_steps, batch))
    means = rng.normal(size=(num_classes, 1, 1, 3))
    image = means[label] + rng.normal(size=(n_steps, batch, image_size, image_size, 3))
    return {'image': image.astype(np.float32), 'label': label.astype(np.int32)}


def save_checkpoint(state, workdir):
    """The example's saver: replica 0 on the host, flax's Orbax-backed ``checkpoint_<step>``."""
    state = jax.device_get(jax.tree_util.tree_map(lambda x: x[0], state))
    checkpoints.save_checkpoint(workdir, state, int(state.step), keep=3)


p_train_step = jax.pmap(functools.partial(train_step, learning_rate_fn=learning_rate_fn), axis_name='batch')
