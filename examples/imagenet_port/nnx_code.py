"""The same classifier ported to NNX, as the Flax docs teach (not part of the suite).

Modules own their submodules by attribute; ``nnx.BatchNorm`` needs no ``axis_name`` (the
global batch is one array, so its statistics are already global); one ``nnx.jit`` step over
the model and its ``nnx.Optimizer``, no ``pmean``. No loss scaling: float32 throughout.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

NUM_CLASSES, MOMENTUM, BASE_LR, WARMUP_STEPS, TOTAL_STEPS = 10, 0.9, 0.1, 2, 20


class ResNetBlock(nnx.Module):
    def __init__(self, filters: int, *, rngs: nnx.Rngs, bn_momentum: float = 0.9):
        norm = functools.partial(nnx.BatchNorm, filters, momentum=bn_momentum, epsilon=1e-5, rngs=rngs)
        self.conv1 = nnx.Conv(filters, filters, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = norm()
        self.conv2 = nnx.Conv(filters, filters, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = norm(scale_init=nnx.initializers.zeros)

    def __call__(self, x, train: bool = True):
        y = nnx.relu(self.bn1(self.conv1(x), use_running_average=not train))
        return nnx.relu(x + self.bn2(self.conv2(y), use_running_average=not train))


class ResNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, num_filters: int = 8, bn_momentum: float = 0.9):
        self.conv_init = nnx.Conv(3, num_filters, (3, 3), use_bias=False, rngs=rngs)
        self.bn_init = nnx.BatchNorm(num_filters, momentum=bn_momentum, epsilon=1e-5, rngs=rngs)
        self.block = ResNetBlock(num_filters, rngs=rngs, bn_momentum=bn_momentum)
        self.head = nnx.Linear(num_filters, NUM_CLASSES, rngs=rngs)

    def __call__(self, x, train: bool = True):
        x = nnx.relu(self.bn_init(self.conv_init(x), use_running_average=not train))
        return self.head(jnp.mean(self.block(x, train), axis=(1, 2)))


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
