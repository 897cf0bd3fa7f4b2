"""A Dense bias right before BatchNorm: correct, and with BatchNorm's momentum slipped.

BatchNorm subtracts the batch mean, so the bias before it has a true gradient of exactly 0.
Its float32 gradient is rounding noise, which Adam's ``g / (sqrt(v) + eps)`` turns into
steps the size of the learning rate: two correct implementations that sum in another order
end with this bias far apart (8e-3 measured, issue 16), while every loss agrees.

The linen side averages BatchNorm statistics over the pmap axis (``axis_name='batch'``), as
a pmap-era model must; ``nnx.BatchNorm`` sees the global batch and needs none.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from equivalence import ModelPort
from equivalence.core.port import workloads
from equivalence.corpus.entry import Entry

FEATURES, HIDDEN, MOMENTUM = 20, 32, 0.9


class LinenBiasBN(nn.Module):
    @nn.compact
    def __call__(self, x_BxF: jax.Array, train: bool) -> jax.Array:
        h = nn.Dense(HIDDEN, name='fc1')(x_BxF)  # its bias: BatchNorm removes it again
        bn = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM, axis_name='batch' if train else None)
        return nn.Dense(1, name='out')(nn.relu(bn(h)))


class NnxBiasBN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, momentum: float = MOMENTUM):
        self.fc1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.norm = nnx.BatchNorm(HIDDEN, momentum=momentum, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)

    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.norm(self.fc1(x_BxF))))


def linen_loss(model, params, model_state, batch, noise):
    pred_Bx1, new_state = model.apply(
        {'params': params, **model_state}, batch['x'], train=True, mutable=['batch_stats']
    )
    return jnp.mean((pred_Bx1 - batch['y']) ** 2, axis=-1), new_state


def nnx_loss(model, batch, noise):
    return jnp.mean((model(batch['x']) - batch['y']) ** 2, axis=-1)


PORT = ModelPort(
    name='bias-before-bn',
    legacy_model=LinenBiasBN,
    nnx_model=lambda rngs: NnxBiasBN(rngs=rngs),
    legacy_loss=linen_loss,
    nnx_loss=nnx_loss,
    make_data=workloads.mlp_data,
    make_tx=lambda lr_scale=1.0: optax.adam(1e-3 * lr_scale),
    init_args=lambda batch: (batch['x'], False),
    names={'BatchNorm_0': 'norm'},
    default_batch=64,
    summary='Dense 20->32 with bias, BatchNorm, relu, Dense 32->1; Adam',
)

# PyTorch's momentum=0.1 is flax's 0.9 (the weight of the old statistics): copied as it is.
MOMENTUM_SLIP = dataclasses.replace(
    PORT, name='bn-momentum', nnx_model=lambda rngs: NnxBiasBN(rngs=rngs, momentum=1 - MOMENTUM)
)

ENTRIES = [
    Entry(
        'bias-before-bn',
        'correct',
        PORT,
        'Dense bias before BatchNorm: true gradient 0, Adam amplifies rounding',
        quick=True,
    ),
    Entry(
        'bn-momentum',
        'slip',
        MOMENTUM_SLIP,
        "NNX BatchNorm momentum 0.1 (PyTorch's convention), linen 0.9",
        kind='state',
        quick=True,
    ),
]
