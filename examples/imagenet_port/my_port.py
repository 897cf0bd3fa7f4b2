"""The image classifier's port, told to the suite: level 1 (the two models) and level 2 (the two
steps, passed as written: ``train_step(state, batch, learning_rate_fn)`` and NNX's ``train_step``).

python -m equivalence.run --workload my_port:LOOP
python -m equivalence.run --workload my_port:MODEL
python -m equivalence.run --workload my_port:LOOP_BN_MOMENTUM_SLIP   # exit 1: the batch statistics
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import legacy_code as old
import nnx_code as new
import optax
from flax import nnx

from equivalence import LoopPort, ModelPort

NAMES = {'ResNetBlock_0/Conv_0': 'block/conv1', 'ResNetBlock_0/BatchNorm_0': 'block/bn1', 'Dense_0': 'head',
         'ResNetBlock_0/Conv_1': 'block/conv2', 'ResNetBlock_0/BatchNorm_1': 'block/bn2'}  # fmt: skip

# Level 2: the team's pmap step and the NNX step, each called once per step.
LOOP = LoopPort(
    name='imagenet-port',
    legacy_model=old.ResNet,
    nnx_model=lambda rngs: new.ResNet(rngs=rngs),
    make_data=old.make_data,
    legacy_state=lambda v: old.create_train_state(v['params'], v['batch_stats']),
    legacy_step=functools.partial(old.train_step, learning_rate_fn=old.learning_rate_fn),
    new_state=lambda model: (model, new.create_optimizer(model)),
    new_step=lambda ts, batch: new.train_step(*ts, batch),
    step_form='state',
    loss='loss',
    init_args=lambda batch: (batch['image'], False),  # ResNet.init(image, train=False)
    names=NAMES,
    default_batch=16,
    skip=('dynamic_scale',),  # the mixed-precision loss scale: NNX has no place for it, left behind on purpose
)


# Level 1: the suite's loops train the two models.
def linen_loss(model, params, model_state, batch, noise):
    logits, new_state = model.apply({'params': params, **model_state}, batch['image'], mutable=['batch_stats'])
    l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']) + 0.00005 * l2, new_state


def nnx_loss(model, batch, noise):
    l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if x.ndim > 1)
    return optax.softmax_cross_entropy_with_integer_labels(model(batch['image']), batch['label']) + 0.00005 * l2


MODEL = ModelPort(name='imagenet-model', legacy_model=old.ResNet, nnx_model=LOOP.nnx_model, legacy_loss=linen_loss,
                  nnx_loss=nnx_loss, make_data=old.make_data, make_tx=lambda s: optax.sgd(
                      lambda step: old.learning_rate_fn(step) * s, momentum=old.MOMENTUM, nesterov=True),
                  init_args=LOOP.init_args, names=NAMES, default_batch=16)  # fmt: skip

# A porting slip: nnx.BatchNorm's default momentum (0.99) where the linen model said 0.9.
LOOP_BN_MOMENTUM_SLIP = dataclasses.replace(LOOP, nnx_model=lambda rngs: new.ResNet(rngs=rngs, bn_momentum=0.99))
