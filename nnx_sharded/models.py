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
