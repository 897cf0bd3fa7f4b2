"""NNX modules of every workload, mirroring ``legacy_pmap/models.py`` line for line.

Attribute names equal the linen submodule names, so a parameter's path (``hidden/kernel``)
is the same string on both sides; Linear kernels are ``(in, out)`` as linen's Dense.
"""

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
    """The regression MLP of the original question: Linear 20 -> 30 -> 1."""

    def __init__(self, din: int = 20, hidden: int = 30, out: int = 1, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(din, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, out, rngs=rngs)

    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        h_BxH = nnx.relu(self.hidden(x_BxF))
        return self.out(h_BxH)


class WideMLP(nnx.Module):
    """Wide enough to shard on 8 devices in every strategy: 64 -> 256 -> 256 -> 8, GELU."""

    def __init__(self, din: int = 64, hidden: int = 256, out: int = 8, *, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(din, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, out, rngs=rngs)

    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        h_BxH = nnx.gelu(self.fc1(x_BxF))
        h_BxH = nnx.gelu(self.fc2(h_BxH))
        return self.out(h_BxH)


def time_embedding(sigma_B: jax.Array, dim: int) -> jax.Array:
    """Sinusoidal embedding of log(sigma), as NCSN++ conditions on the noise level."""
    freqs = jnp.exp(jnp.linspace(0.0, jnp.log(100.0), dim // 2))
    arg_BxE = jnp.log(sigma_B)[:, None] * freqs[None, :]
    return jnp.concatenate([jnp.sin(arg_BxE), jnp.cos(arg_BxE)], axis=-1)


class ScoreNet(nnx.Module):
    """A small time-conditioned score network: s(x, sigma) ~ grad log p_sigma(x)."""

    def __init__(self, dim: int = 2, hidden: int = 64, embed: int = 16, *, rngs: nnx.Rngs):
        self.embed = embed
        self.embed_x = nnx.Linear(dim, hidden, rngs=rngs)
        self.embed_t = nnx.Linear(embed, hidden, rngs=rngs)
        self.hidden = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, dim, rngs=rngs)

    def __call__(self, x_BxD: jax.Array, sigma_B: jax.Array) -> jax.Array:
        temb_BxE = time_embedding(sigma_B, self.embed)
        h_BxH = self.embed_x(x_BxD)
        h_BxH = nnx.swish(h_BxH + self.embed_t(temb_BxE))
        h_BxH = nnx.swish(self.hidden(h_BxH))
        out_BxD = self.out(h_BxH)
        return out_BxD / sigma_B[:, None]  # score_sde's scale_by_sigma


def dropout(x: jax.Array, keep_mask: jax.Array | None, rate: float) -> jax.Array:
    """``nnx.Dropout(rate)(x, rngs=key)`` with its mask drawn outside, by the step:
    ``keep_mask = random.bernoulli(key, 1 - rate, x.shape)`` gives the same bits, and the
    step can then draw per device or globally (see train.draw_noise). None: evaluation."""
    if keep_mask is None:
        return x
    return jax.lax.select(keep_mask, x / (1.0 - rate), jnp.zeros_like(x))


class CNN(nnx.Module):
    """A small convolutional classifier of 8x8 digits, with BatchNorm and Dropout.

    ``nnx.BatchNorm`` needs no axis name: it averages over the batch it is given, which
    here is the global batch, sharded; XLA all-reduces the statistics across devices.
    The convolutions have no bias: BatchNorm subtracts it again, so its true gradient is
    zero and Adam would turn the rounding noise left in it into full-size steps. For the
    same reason the dense layer reads 2x2-pooled features, not the raw 4x4 map: the map's
    border cells of these digits are ~0 after BatchNorm + ReLU, their weights get ~1e-12
    gradients, and Adam's lr/eps gain made two float32 orders differ by 2e-5 (measured).
    """

    def __init__(self, channels: int = 1, classes: int = 10, dropout_rate: float = 0.25, *, rngs: nnx.Rngs):
        self.dropout_rate = dropout_rate
        self.conv1 = nnx.Conv(channels, 16, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(32, momentum=0.9, rngs=rngs)
        self.hidden = nnx.Linear(2 * 2 * 32, 64, rngs=rngs)
        self.out = nnx.Linear(64, classes, rngs=rngs)

    def __call__(self, x_BxHxWxC: jax.Array, keep_mask: jax.Array | None = None) -> jax.Array:
        h = nnx.relu(self.bn1(self.conv1(x_BxHxWxC)))
        h = nnx.relu(self.bn2(self.conv2(h)))
        h_BxF = nnx.avg_pool(h, (2, 2), strides=(2, 2)).reshape(h.shape[0], -1)
        h_BxH = dropout(nnx.relu(self.hidden(h_BxF)), keep_mask, self.dropout_rate)
        return self.out(h_BxH)
