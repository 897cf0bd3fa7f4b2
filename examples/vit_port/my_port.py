"""The Vision Transformer's port, told to the suite at level 2: the team's pmapped
``update_fn(params, opt_state, batch, rng)`` (its ``__wrapped__``, as the suite pmaps it itself)
and the NNX ``train_step``, each called once per step with a fresh key.

python -m equivalence.run --workload my_port:LOOP            # SGD momentum in bfloat16, as upstream
python -m equivalence.run --workload my_port:LOOP_FLOAT32    # the same with the momentum in float32
python -m equivalence.run --workload my_port:LOOP_GELU_SLIP  # exit 1: one encoder block's gelu is exact
python -m equivalence.run --workload my_port:LOOP_DEVICE_KEYS  # exit 5: NOT VERIFIED (other dropout masks)
"""

import dataclasses

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
