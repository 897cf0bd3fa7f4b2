"""The same classifier ported to NNX, as the Flax docs teach (not part of the suite).

Modules own their submodules by attribute; ``nnx.BatchNorm`` needs no ``axis_name`` (the
global batch is one array, so its statistics are already global); one ``nnx.jit`` step over
the model and its ``nnx.Optimizer``, no ``pmean``. No loss scaling: float32 throughout. The sizes
are the constructor's arguments (``bottleneck=True`` for linen's ``BottleneckResNetBlock``); the
defaults are the shrunk model, one block in ``blocks``.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

NUM_CLASSES, MOMENTUM, BASE_LR, WARMUP_STEPS, TOTAL_STEPS = 10, 0.9, 0.1, 2, 20


class ResNetBlock(nnx.Module):
    def __init__(self, in_filters: int, filters: int, *, rngs: nnx.Rngs, strides: int = 1, bn_momentum: float = 0.9):
        conv, norm = conv_norm(rngs, bn_momentum)
        self.conv1, self.bn1 = conv(in_filters, filters, (3, 3), strides=strides), norm(filters)
        self.conv2, self.bn2 = conv(filters, filters, (3, 3)), norm(filters, scale_init=nnx.initializers.zeros)
        self.shortcut = (in_filters, strides) != (filters, 1)
        if self.shortcut:  # linen's conv_proj and norm_proj: the block changes the shape
            self.conv_proj, self.norm_proj = conv(in_filters, filters, (1, 1), strides=strides), norm(filters)

    def __call__(self, x, train: bool = True):
        y = nnx.relu(self.bn1(self.conv1(x), use_running_average=not train))
        y = self.bn2(self.conv2(y), use_running_average=not train)
        return nnx.relu(self.residual(x, train) + y)

    def residual(self, x, train: bool):
        return self.norm_proj(self.conv_proj(x), use_running_average=not train) if self.shortcut else x


class BottleneckResNetBlock(ResNetBlock):
    def __init__(self, in_filters: int, filters: int, *, rngs: nnx.Rngs, strides: int = 1, bn_momentum: float = 0.9):
        conv, norm = conv_norm(rngs, bn_momentum)
        self.conv1, self.bn1 = conv(in_filters, filters, (1, 1)), norm(filters)
        self.conv2, self.bn2 = conv(filters, filters, (3, 3), strides=strides), norm(filters)
        self.conv3, self.bn3 = conv(filters, filters * 4, (1, 1)), norm(filters * 4, scale_init=nnx.initializers.zeros)
        self.shortcut = (in_filters, strides) != (filters * 4, 1)
        if self.shortcut:
            self.conv_proj, self.norm_proj = conv(in_filters, filters * 4, (1, 1), strides=strides), norm(filters * 4)

    def __call__(self, x, train: bool = True):
        y = nnx.relu(self.bn1(self.conv1(x), use_running_average=not train))
        y = nnx.relu(self.bn2(self.conv2(y), use_running_average=not train))
        y = self.bn3(self.conv3(y), use_running_average=not train)
        return nnx.relu(self.residual(x, train) + y)


def conv_norm(rngs: nnx.Rngs, bn_momentum: float):
    conv = functools.partial(nnx.Conv, use_bias=False, rngs=rngs)
    return conv, functools.partial(nnx.BatchNorm, momentum=bn_momentum, epsilon=1e-5, rngs=rngs)


class ResNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, num_filters: int = 8, bn_momentum: float = 0.9, stage_sizes=(1,),
                 bottleneck: bool = False, num_classes: int = NUM_CLASSES, imagenet_stem: bool = False):  # fmt: skip
        conv, norm = conv_norm(rngs, bn_momentum)
        self.imagenet_stem = imagenet_stem  # a 7x7/2 convolution and a 3x3/2 max pool; else one 3x3 convolution
        stem = dict(kernel_size=(7, 7), strides=2, padding=[(3, 3), (3, 3)]) if imagenet_stem else {}
        self.conv_init, self.bn_init = conv(3, num_filters, **({'kernel_size': (3, 3)} | stem)), norm(num_filters)
        block, expansion = (BottleneckResNetBlock, 4) if bottleneck else (ResNetBlock, 1)
        self.blocks, filters = nnx.List(), num_filters
        for i, block_size in enumerate(stage_sizes):
            for j in range(block_size):
                strides, width = (2 if i > 0 and j == 0 else 1), num_filters * 2**i
                self.blocks.append(block(filters, width, rngs=rngs, strides=strides, bn_momentum=bn_momentum))
                filters = width * expansion
        self.head = nnx.Linear(filters, num_classes, rngs=rngs)

    def __call__(self, x, train: bool = True):
        x = nnx.relu(self.bn_init(self.conv_init(x), use_running_average=not train))
        if self.imagenet_stem:
            x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding='SAME')
        for block in self.blocks:
            x = block(x, train)
        return self.head(jnp.mean(x, axis=(1, 2)))


warmup_fn = optax.linear_schedule(0.0, BASE_LR, WARMUP_STEPS)
cosine_fn = optax.cosine_decay_schedule(BASE_LR, TOTAL_STEPS - WARMUP_STEPS)
learning_rate_fn = optax.join_schedules([warmup_fn, cosine_fn], boundaries=[WARMUP_STEPS])


def create_optimizer(model: ResNet) -> nnx.Optimizer:
    return nnx.Optimizer(model, optax.sgd(learning_rate_fn, momentum=MOMENTUM, nesterov=True), wrt=nnx.Param)


def cross_entropy_loss(logits, labels):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


@nnx.jit
def train_step(model: ResNet, optimizer: nnx.Optimizer, batch):
    def loss_fn(model):
        logits = model(batch['image'], train=True)
        loss = cross_entropy_loss(logits, batch['label'])
        weight_l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if x.ndim > 1)
        return loss + 0.0001 * 0.5 * weight_l2, (loss, logits)

    lr = learning_rate_fn(optimizer.step[...])
    (_, (loss, logits)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch['label'])
    return {'loss': loss, 'accuracy': accuracy, 'learning_rate': lr}
