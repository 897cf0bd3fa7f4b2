"""The Vision Transformer's port, told to the suite at level 2: the team's pmapped
``update_fn(params, opt_state, batch, rng)`` (its ``__wrapped__``, as the suite pmaps it itself)
and the NNX ``train_step``, each called once per step with a fresh key.

python -m equivalence.run --workload my_port:LOOP            # SGD momentum in bfloat16, as upstream
python -m equivalence.run --workload my_port:LOOP_FLOAT32    # the same with the momentum in float32
python -m equivalence.run --workload my_port:LOOP_GELU_SLIP  # exit 1: one encoder block's gelu is exact
python -m equivalence.run --workload my_port:LOOP_DEVICE_KEYS  # exit 5: NOT VERIFIED (other dropout masks)

Real sizes: ``sized(name)`` is ``LOOP`` at one rung of ``LADDER``, the same code with the model's
fields (linen) and arguments (NNX) set, data of that size and the batch that size wants, and its K
steps fused in one call on each side, as training at size runs them: ``update_fn`` under the suite's
``pmap(scan)``, the key it returns handed to the next step as vit_jax's loop hands it (``fused_step``),
against the NNX ``train_steps`` (``jax.jit(lax.scan)`` over the split state, donated: as fast as the
pmap loop, ``python -m equivalence.bench``). Each rung is a module attribute too (``LADDER_2E5``),
``sized(name, slip_in_block=1)`` puts the GELU slip at that size, ``sized(name, head_lr=1.001)`` the
head's learning rate 0.1% off. Parameters counted with ``jax.eval_shape`` of the linen init:

    rung  images, patch  layers x hidden, heads, MLP  classes  parameters  batch
    6e3   8x8, 4         2 x 16, 2, 32                10            5,530     16  (LOOP's size)
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
python -m equivalence.bench --workload my_port:LOOP_B16 --devices 1 --batch-size 16 --steps-per-call 2 --k-scaling 2
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


def legacy_port(accumulator_dtype) -> dict:
    tx = old.make_tx(accumulator_dtype)
    update_fn = old.make_update_fn(apply_fn=old.VisionTransformer().apply, tx=tx).__wrapped__

    def step(state, batch, rng):  # (params, opt_state) as upstream keeps them; the loss is what it returns
        params, opt_state, loss, _ = update_fn(*state, batch, rng)
        return (params, opt_state), loss

    return dict(legacy_state=lambda v: (v['params'], tx.init(v['params'])), legacy_step=step)


def fused_step(model):
    """Upstream's ``update_fn`` as a scan's step, ``((rng, (params, opt_state)), batch) -> (..., loss)``: the key
    it returns is the next step's, as vit_jax's training loop hands ``update_fn`` the key it returned."""
    update_fn = old.make_update_fn(apply_fn=model.apply, tx=old.make_tx('bfloat16')).__wrapped__

    def step(carry, batch):
        rng, (params, opt_state) = carry
        params, opt_state, loss, rng = update_fn(params, opt_state, batch, rng)
        return (rng, (params, opt_state)), loss

    return step


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


# Not a rung: the smallest model with ViT-B's zero-initialised 1000-class head (136,360 parameters, 64,000 of them
# in the head), where a bfloat16 flip of the head's momentum shows in seconds (test_port.py)
SMALL_HEAD = {'1e5': Size(16, 4, 2, 64, 2, 128, 1000, 16)}


def sized(name: str, slip_in_block: int | None = None, head_lr: float = 1.0) -> LoopPort:
    """``LOOP`` at the rung ``name`` of ``LADDER`` (or ``SMALL_HEAD``); ``slip_in_block=1``: with the GELU slip;
    ``head_lr``: the NNX head's updates scaled by it, a slip where upstream has one learning rate."""
    size = {**LADDER, **SMALL_HEAD}[name]
    model = functools.partial(old.VisionTransformer, **size.model())
    slip = ('-gelu-slip' if slip_in_block is not None else '') + (f'-head-lr-{head_lr}' if head_lr != 1.0 else '')
    return dataclasses.replace(
        LOOP,
        name=f'vit-port-{name}' + slip,
        legacy_model=model,
        nnx_model=lambda rngs: new.VisionTransformer(
            rngs=rngs, slip_in_block=slip_in_block, image_size=size.image_size, **size.model()
        ),
        make_data=functools.partial(old.make_data, image_size=size.image_size, num_classes=size.num_classes),
        legacy_state=lambda v: (v['params'], old.make_tx('bfloat16').init(v['params'])),
        legacy_step=fused_step(model()),
        step_form='carry',  # pmap(scan(update_fn)): K steps a call, the key chained as update_fn returns it
        legacy_groups=lambda state: {'params': state[0], 'opt_state': state[1]},  # (params, opt_state), as upstream
        new_state=lambda model: new.split_state(model, new.create_optimizer(model, 'bfloat16', head_lr)),
        new_step=None,
        new_call=lambda ts, key, batch_KxG: new.train_steps(ts, batch_KxG, key),
        default_batch=size.batch,
    )


LADDER_6E3, LADDER_2E5, LADDER_3E6, LADDER_2E7, LADDER_9E7 = (sized(name) for name in LADDER)
LOOP_S, LOOP_B16 = LADDER_2E7, LADDER_9E7
LOOP_B16_GELU_SLIP = sized('9e7', slip_in_block=1)
# each rung's GELU slip, for ``bench --cost --slip``: the cost of a MISMATCH up the ladder
LADDER_6E3_GELU_SLIP, LADDER_2E5_GELU_SLIP, LADDER_3E6_GELU_SLIP, LADDER_2E7_GELU_SLIP, _ = (
    sized(name, slip_in_block=1) for name in LADDER
)
