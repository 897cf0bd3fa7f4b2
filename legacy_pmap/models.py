"""Linen modules of every workload. ``nnx_sharded/models.py`` mirrors this file line for line.

Submodules are named explicitly so that a parameter's path (``hidden/kernel``) is the same
string on both sides; Dense kernels are ``(in, out)`` in linen and NNX alike.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


class MLP(nn.Module):
    """The regression MLP of the original question: Linear 20 -> 30 -> 1."""

    hidden: int = 30
    out: int = 1

    @nn.compact
    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        h_BxH = nn.relu(nn.Dense(self.hidden, name='hidden')(x_BxF))
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
