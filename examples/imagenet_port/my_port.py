"""The image classifier's port, told to the suite: level 1 (the two models) and level 2 (the two
steps, passed as written: ``train_step(state, batch, learning_rate_fn)`` and NNX's ``train_step``).

python -m equivalence.run --workload my_port:LOOP
python -m equivalence.run --workload my_port:MODEL
python -m equivalence.run --workload my_port:LOOP_BN_MOMENTUM_SLIP   # exit 1: the batch statistics

Real sizes: ``sized(name)`` is ``LOOP`` at one of ``SIZES``, the same code with the linen model's
fields and the NNX model's arguments set, data of that size and the batch that size wants;
``sized(name, bn_momentum=0.99)`` puts the slip at that size. Parameters (and BatchNorm statistics)
counted with ``jax.eval_shape`` of the linen init:

    size        blocks             widths     classes  images  parameters (statistics)  batch
    tiny        1 basic            8          10       8x8            1,506 (48)            16  (= LOOP)
    r50-narrow  [3, 4, 6, 3] bneck 8..256     10       32x32        376,722 (6,640)         16
    r50         [3, 4, 6, 3] bneck 64..2048   1000     64x64     25,557,032 (53,120)        64  flax's ResNet50

ResNet-50 has its parameters whatever the images' size; at 64x64 its last stage sees 2x2 (7x7 at
224x224), and a check runs on a CPU in minutes rather than hours. ``r50-narrow`` is the same network
(every block, projection and name) at 1/8 of the width: its check compiles what ResNet-50's does, and on
a CPU takes about as long (compiling is most of it), in less memory.
``LOOP_R50`` and ``LOOP_R50_NARROW`` are those sizes, ``LOOP_R50_BN_MOMENTUM_SLIP`` the slip at ResNet-50:

python -m equivalence.run --workload my_port:LOOP_R50_NARROW --devices 1 --steps-per-call 1 --calls 1 --batch-size 2
python -m equivalence.run --workload my_port:LOOP_R50 --steps-per-call 2 --calls 1 --batch-size 2  # 2-4 min, 3.2 GB
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import legacy_code as old
import nnx_code as new
import optax
from flax import nnx

from equivalence import LoopPort, ModelPort


def names(path: str) -> str:
    """linen's auto-named blocks and layers -> the NNX attributes: ``BottleneckResNetBlock_3/BatchNorm_2`` ->
    ``blocks/3/bn3``; ``conv_init``, ``bn_init``, ``conv_proj`` and ``norm_proj`` keep their names."""
    path = re.sub(r'^(Bottleneck)?ResNetBlock_(\d+)', r'blocks/\2', path)
    path = re.sub(r'(Conv|BatchNorm)_(\d+)', lambda m: f'{"conv" if m[1] == "Conv" else "bn"}{int(m[2]) + 1}', path)
    return path.replace('Dense_0', 'head')


NAMES = names

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


@dataclasses.dataclass(frozen=True)
class Size:
    """One size: the linen model's fields (the NNX model's arguments: ``bottleneck`` for ``block_cls``), the
    images, the batch."""

    stage_sizes: tuple[int, ...]
    bottleneck: bool
    num_filters: int
    num_classes: int
    imagenet_stem: bool
    image_size: int
    batch: int  # the port's default global batch

    def nnx(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ('image_size', 'batch')}

    def linen(self) -> dict:
        block = old.BottleneckResNetBlock if self.bottleneck else old.ResNetBlock
        return {**{k: v for k, v in self.nnx().items() if k != 'bottleneck'}, 'block_cls': block}


SIZES = {  # parameters: see the module docstring
    'tiny': Size((1,), False, 8, 10, False, 8, 16),
    'r50-narrow': Size((3, 4, 6, 3), True, 8, 10, True, 32, 16),
    'r50': Size((3, 4, 6, 3), True, 64, 1000, True, 64, 64),
}


def sized(name: str, bn_momentum: float = 0.9) -> LoopPort:
    """``LOOP`` at the size ``name`` of ``SIZES``; ``bn_momentum=0.99``: with the slip."""
    size = SIZES[name]
    model = functools.partial(old.ResNet, **size.linen())
    return dataclasses.replace(
        LOOP,
        name=f'imagenet-port-{name}' + ('-bn-momentum-slip' if bn_momentum != 0.9 else ''),
        legacy_model=model,
        nnx_model=lambda rngs: new.ResNet(rngs=rngs, bn_momentum=bn_momentum, **size.nnx()),
        make_data=functools.partial(old.make_data, image_size=size.image_size, num_classes=size.num_classes),
        legacy_state=lambda v: old.create_train_state(v['params'], v['batch_stats'], model=model()),
        default_batch=size.batch,
    )


LOOP_TINY, LOOP_R50_NARROW, LOOP_R50 = (sized(name) for name in SIZES)
LOOP_R50_BN_MOMENTUM_SLIP = sized('r50', bn_momentum=0.99)
