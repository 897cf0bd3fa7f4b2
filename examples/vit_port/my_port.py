"""The Vision Transformer's port, told to the suite at level 2: the team's pmapped
``update_fn(params, opt_state, batch, rng)`` (its ``__wrapped__``, as the suite pmaps it itself)
and the NNX ``train_step``, each called once per step with a fresh key.

python -m equivalence.run --workload my_port:LOOP            # SGD momentum in bfloat16, as upstream
python -m equivalence.run --workload my_port:LOOP_FLOAT32    # the same with the momentum in float32
python -m equivalence.run --workload my_port:LOOP_GELU_SLIP  # exit 1: one encoder block's gelu is exact
python -m equivalence.run --workload my_port:LOOP_DEVICE_KEYS  # exit 5: NOT VERIFIED (other dropout masks)

Real sizes: ``sized(name)`` is ``LOOP`` at one rung of ``LADDER``, the same code with the model's
fields (linen) and arguments (NNX) set, data of that size and the batch that size wants; each rung is
a module attribute too (``LADDER_2E5``), and ``sized(name, slip_in_block=1)`` puts the GELU slip at
that size. Parameters counted with ``jax.eval_shape`` of the linen init:

    rung  images, patch  layers x hidden, heads, MLP  classes  parameters  batch
    6e3   8x8, 4         2 x 16, 2, 32                10            5,530     16  (= LOOP)
    2e5   32x32, 4       4 x 64, 4, 256               10          208,074     32
    3e6   64x64, 8       6 x 192, 3, 768              1000      2,912,296     64
    2e7   64x64, 8       12 x 384, 6, 1536            1000     21,778,792     64  ViT-S depth and width
    9e7   64x64, 8       12 x 768, 12, 3072           1000     86,023,912     64  ViT-B/16 depth and width

The last is ViT-B/16's encoder and head exactly; its patch embedding (8x8x3 -> 768) and position
embedding (65 tokens) are those of 64x64 images, where B/16 at 224x224 has 16x16x3 and 197
(86,567,656 parameters in all). ``LOOP_B16`` is that rung, ``LOOP_B16_GELU_SLIP`` its slip,
``LOOP_S`` the ViT-S rung. ``--batch-size`` overrides the batch:

python -m equivalence.run --workload my_port:LADDER_2E5 --devices 1 --steps-per-call 1 --calls 1 --batch-size 2
python -m equivalence.run --workload my_port:LOOP_B16 --steps-per-call 2 --calls 1 --batch-size 2  # 2-4 min, 4.6 GB
"""

import dataclasses
import functools

import jax
import legacy_code as old
import nnx_code as new

from equivalence import LoopPort


def block_names(path: str) -> str:
    """linen's auto-named submodules of an encoder block -> the NNX attributes."""
    for a, b in (('Transformer/encoderblock_', 'encoder/blocks/'), ('Transformer/', 'encoder/'),
                 ('LayerNorm_0', 'norm1'), ('LayerNorm_1', 'norm2'), ('MultiHeadDotProductAttention_0', 'attn'),
                 ('MlpBlock_0/Dense_0', 'mlp/fc1'), ('MlpBlock_0/Dense_1', 'mlp/fc2')):  # fmt: skip
        path = path.replace(a, b)
    return path


def legacy_port(accumulator_dtype, model=None) -> dict:
    tx = old.make_tx(accumulator_dtype)
    update_fn = old.make_update_fn(apply_fn=(model or old.VisionTransformer()).apply, tx=tx).__wrapped__

    def step(state, batch, rng):  # (params, opt_state) as upstream keeps them; the loss is what it returns
        params, opt_state, loss, _ = update_fn(*state, batch, rng)
        return (params, opt_state), loss

    return dict(legacy_state=lambda v: (v['params'], tx.init(v['params'])), legacy_step=step)


LOOP = LoopPort(
    name='vit-port',
    legacy_model=old.VisionTransformer,
    nnx_model=lambda rngs: new.VisionTransformer(rngs=rngs),
    make_data=old.make_data,
    **legacy_port('bfloat16'),
    new_state=lambda model: (model, new.create_optimizer(model, 'bfloat16')),
    new_step=lambda ts, batch, key: new.train_step(*ts, batch, key),
    step_form='state_rng',
    init_args=lambda batch: (batch['image'], False),  # VisionTransformer.init(image, train=False)
    names=block_names,
    rng_modes=('global',),  # the NNX step takes one key for the global batch
    default_batch=16,
)
LOOP_FLOAT32 = dataclasses.replace(
    LOOP,
    name='vit-port-float32',
    **legacy_port(None),
    new_state=lambda model: (model, new.create_optimizer(model, None)),
)

# A porting slip in one encoder block: its MLP's gelu exact, where linen's is the tanh approximation.
LOOP_GELU_SLIP = dataclasses.replace(LOOP, nnx_model=lambda rngs: new.VisionTransformer(rngs=rngs, slip_in_block=1))

# A port that draws other random numbers, where the first losses cannot show it: the NNX step binds its
# dropout key to the size of the mesh the batch is spread over (as upstream bound it to the device
# index). It draws other masks than the pmap step, and the twin on another mesh draws others again;
# with the head zero-initialised and no update at step 1 (warmup), the first two losses are equal
# whatever the masks, so the twin is taken, and every floor is as large as the difference itself.
# Exit 5, NOT VERIFIED: never a MATCH.
LOOP_DEVICE_KEYS = dataclasses.replace(
    LOOP,
    name='vit-port-device-keys',
    new_step=lambda ts, batch, key: new.train_step(
        *ts, batch, jax.random.fold_in(key, jax.typeof(batch['image']).sharding.mesh.size)
    ),
)


@dataclasses.dataclass(frozen=True)
class Size:
    """One rung: the model's sizes (linen fields, NNX arguments of the same names), the images, the batch."""

    image_size: int
    patch_size: int
    num_layers: int
    hidden_size: int
    num_heads: int
    mlp_dim: int
    num_classes: int
    batch: int  # the port's default global batch

    def model(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ('image_size', 'batch')}


LADDER = {  # parameters, rounded: see the module docstring
    '6e3': Size(8, 4, 2, 16, 2, 32, 10, 16),
    '2e5': Size(32, 4, 4, 64, 4, 256, 10, 32),
    '3e6': Size(64, 8, 6, 192, 3, 768, 1000, 64),
    '2e7': Size(64, 8, 12, 384, 6, 1536, 1000, 64),
    '9e7': Size(64, 8, 12, 768, 12, 3072, 1000, 64),
}


def sized(name: str, slip_in_block: int | None = None) -> LoopPort:
    """``LOOP`` at the rung ``name`` of ``LADDER``; ``slip_in_block=1``: with the GELU slip."""
    size = LADDER[name]
    model = functools.partial(old.VisionTransformer, **size.model())
    return dataclasses.replace(
        LOOP,
        name=f'vit-port-{name}' + ('-gelu-slip' if slip_in_block is not None else ''),
        legacy_model=model,
        nnx_model=lambda rngs: new.VisionTransformer(
            rngs=rngs, slip_in_block=slip_in_block, image_size=size.image_size, **size.model()
        ),
        make_data=functools.partial(old.make_data, image_size=size.image_size, num_classes=size.num_classes),
        **legacy_port('bfloat16', model()),
        default_batch=size.batch,
    )


LADDER_6E3, LADDER_2E5, LADDER_3E6, LADDER_2E7, LADDER_9E7 = (sized(name) for name in LADDER)
LOOP_S, LOOP_B16 = LADDER_2E7, LADDER_9E7
LOOP_B16_GELU_SLIP = sized('9e7', slip_in_block=1)
# each rung's GELU slip, for ``bench --cost --slip``: the cost of a MISMATCH up the ladder
LADDER_6E3_GELU_SLIP, LADDER_2E5_GELU_SLIP, LADDER_3E6_GELU_SLIP, LADDER_2E7_GELU_SLIP, _ = (
    sized(name, slip_in_block=1) for name in LADDER
)
