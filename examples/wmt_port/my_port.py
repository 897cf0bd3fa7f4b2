"""The Transformer's port, told to the suite: level 1 (the two models, token-weighted loss) and
level 2 (the two steps as written: ``train_step(state, batch, ..., dropout_rng=)`` and NNX's).

python -m equivalence.run --workload my_port:LOOP
python -m equivalence.run --workload my_port:MODEL
python -m equivalence.run --workload my_port:LOOP_BROADCAST_DROPOUT_SLIP   # exit 1
"""

import dataclasses
import functools

import jax.numpy as jnp
import legacy_code as old
import nnx_code as new
import optax

from equivalence import LoopPort, ModelPort

NAMES = {'Embed_0': 'embed', 'DecoderBlock_0/LayerNorm_0': 'block/ln1', 'DecoderBlock_0/LayerNorm_1': 'block/ln2',
         'DecoderBlock_0/MultiHeadDotProductAttention_0': 'block/attn', 'DecoderBlock_0/Dense_0': 'block/fc1',
         'DecoderBlock_0/Dense_1': 'block/fc2', 'LayerNorm_0': 'ln_out', 'Dense_0': 'head'}  # fmt: skip

# Level 2: the team's pmap step and the NNX step, each called once per step with a fresh key.
LOOP = LoopPort(
    name='wmt-port',
    legacy_model=old.Decoder,
    nnx_model=lambda rngs: new.Decoder(rngs=rngs),
    make_data=old.make_data,
    legacy_state=lambda v: old.create_train_state(v['params']),
    legacy_step=functools.partial(
        old.train_step, learning_rate_fn=old.learning_rate_fn, label_smoothing=old.LABEL_SMOOTHING
    ),  # fmt: skip
    new_state=lambda model: (model, new.create_optimizer(model)),
    new_step=lambda ts, batch, key: new.train_step(*ts, batch, key),
    step_form='state_rng',
    rng_arg='dropout_rng',
    loss=lambda m: m['loss'] / m['denominator'],
    init_args=lambda batch: (batch['targets'], False),
    names=NAMES,
    rng_modes=('global',),  # the NNX step folds one key, not a [D, 2] array of them
    default_batch=16,
)


# Level 1: the suite's loops train the two models; the loss is a sum over real tokens.
def linen_loss(model, params, model_state, batch, noise):
    t = batch['targets']
    logits = model.apply({'params': params}, t, train=True)
    w = (t > 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy(logits, optax.smooth_labels(jax_one_hot(t), 0.1 * 16 / 15))
    return {'loss': jnp.sum(ce * w, -1), 'weight': jnp.sum(w, -1)}


def nnx_loss(model, batch, noise):
    t = batch['targets']
    w = (t > 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy(model(t), optax.smooth_labels(jax_one_hot(t), 0.1 * 16 / 15))
    return {'loss': jnp.sum(ce * w, -1), 'weight': jnp.sum(w, -1)}


def jax_one_hot(t):
    return (t[..., None] == jnp.arange(old.VOCAB)).astype(jnp.float32)


MODEL = ModelPort(name='wmt-model', legacy_model=old.Decoder, nnx_model=LOOP.nnx_model, legacy_loss=linen_loss,
                  nnx_loss=nnx_loss, make_data=functools.partial(old.make_data, real=None),
                  make_tx=lambda s: optax.adamw(lambda step: old.learning_rate_fn(step) * s, b1=0.9, b2=0.98,
                                                eps=1e-9, weight_decay=0.0),
                  init_args=LOOP.init_args, names=NAMES, default_batch=16)  # fmt: skip

# A porting slip: NNX attention left at broadcast_dropout=True (its default) where linen said False.
LOOP_BROADCAST_DROPOUT_SLIP = dataclasses.replace(
    LOOP, nnx_model=lambda rngs: new.Decoder(rngs=rngs, broadcast_dropout=True)
)
# The wild step's per-device token mean, on rows of their own lengths: the masked-loss pitfall at D > 1.
LOOP_UNPACKED = dataclasses.replace(LOOP, make_data=functools.partial(old.make_data, real=None))
