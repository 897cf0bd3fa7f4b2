"""Linen modules of every workload. ``nnx_sharded/models.py`` mirrors this file line for line.

Submodules are named explicitly so that a parameter's path (``hidden/kernel``) is the same
string on both sides; Dense kernels are ``(in, out)`` in linen and NNX alike.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from legacy_pmap.train import AXIS


class MLP(nn.Module):
    """The regression MLP of the original question: Linear 20 -> 30 -> 1."""

    hidden: int = 30
    out: int = 1

    @nn.compact
    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        h_BxH = nn.relu(nn.Dense(self.hidden, name='hidden')(x_BxF))
        return nn.Dense(self.out, name='out')(h_BxH)


class WideMLP(nn.Module):
    """Wide enough to shard on 8 devices in every strategy: 64 -> 256 -> 256 -> 8, GELU."""

    hidden: int = 256
    out: int = 8

    @nn.compact
    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        h_BxH = nn.gelu(nn.Dense(self.hidden, name='fc1')(x_BxF))
        h_BxH = nn.gelu(nn.Dense(self.hidden, name='fc2')(h_BxH))
        return nn.Dense(self.out, name='out')(h_BxH)


def time_embedding(sigma_B: jax.Array, dim: int) -> jax.Array:
    """Sinusoidal embedding of log(sigma), as NCSN++ conditions on the noise level."""
    freqs = jnp.exp(jnp.linspace(0.0, jnp.log(100.0), dim // 2))
    arg_BxE = jnp.log(sigma_B)[:, None] * freqs[None, :]
    return jnp.concatenate([jnp.sin(arg_BxE), jnp.cos(arg_BxE)], axis=-1)


class ScoreNet(nn.Module):
    """A small time-conditioned score network: s(x, sigma) ~ grad log p_sigma(x)."""

    dim: int = 2
    hidden: int = 64
    embed: int = 16

    @nn.compact
    def __call__(self, x_BxD: jax.Array, sigma_B: jax.Array) -> jax.Array:
        temb_BxE = time_embedding(sigma_B, self.embed)
        h_BxH = nn.Dense(self.hidden, name='embed_x')(x_BxD)
        h_BxH = nn.swish(h_BxH + nn.Dense(self.hidden, name='embed_t')(temb_BxE))
        h_BxH = nn.swish(nn.Dense(self.hidden, name='hidden')(h_BxH))
        out_BxD = nn.Dense(self.dim, name='out')(h_BxH)
        return out_BxD / sigma_B[:, None]  # score_sde's scale_by_sigma


def dropout(x: jax.Array, keep_mask: jax.Array | None, rate: float) -> jax.Array:
    """``nn.Dropout(rate)(x, rng=key)`` with its mask drawn outside, by the step:
    ``keep_mask = random.bernoulli(key, 1 - rate, x.shape)`` gives the same bits, and the
    step can then draw per device or globally (see train.draw_noise). None: evaluation."""
    if keep_mask is None:
        return x
    return jax.lax.select(keep_mask, x / (1.0 - rate), jnp.zeros_like(x))


class CNN(nn.Module):
    """A small convolutional classifier of 8x8 digits, with BatchNorm and Dropout.

    ``bn_axis_name``: BatchNorm averages its batch statistics over this pmap axis while
    training, so every replica normalises with the statistics of the global batch.
    None gives per-device statistics: the classic porting bug.
    The convolutions have no bias: BatchNorm subtracts it again, so its true gradient is
    zero and Adam would turn the rounding noise left in it into full-size steps. For the
    same reason the dense layer reads 2x2-pooled features, not the raw 4x4 map: the map's
    border cells of these digits are ~0 after BatchNorm + ReLU, their weights get ~1e-12
    gradients, and Adam's lr/eps gain made two float32 orders differ by 2e-5 (measured).
    """

    classes: int = 10
    dropout_rate: float = 0.25
    bn_axis_name: str | None = AXIS

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array, train: bool, keep_mask: jax.Array | None = None) -> jax.Array:
        norm = lambda name: nn.BatchNorm(  # noqa: E731
            use_running_average=not train, momentum=0.9, axis_name=self.bn_axis_name if train else None, name=name
        )
        h = nn.relu(norm('bn1')(nn.Conv(16, (3, 3), use_bias=False, name='conv1')(x_BxHxWxC)))
        h = nn.relu(norm('bn2')(nn.Conv(32, (3, 3), strides=2, use_bias=False, name='conv2')(h)))
        h_BxF = nn.avg_pool(h, (2, 2), strides=(2, 2)).reshape(h.shape[0], -1)
        h_BxH = dropout(nn.relu(nn.Dense(64, name='hidden')(h_BxF)), keep_mask, self.dropout_rate)
        return nn.Dense(self.classes, name='out')(h_BxH)
