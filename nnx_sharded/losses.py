"""Per-example losses, and the random numbers each one consumes.

Mirrors ``legacy_pmap/losses.py``. A loss is split in two so that the sharded path can
draw *exactly* the random numbers each pmap device draws (see ``train.draw_noise``):

- ``*_noise(key, batch)`` draws every random number one step needs for a batch shaped
  as ``batch`` (its shapes and dtypes) (pure JAX, identical on both sides);
- ``*_loss(model, batch, noise)`` is deterministic given the noise and returns one loss
  per example; NNX updates mutable state (batch statistics) in place.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

SIGMA_MIN = 0.01  # VE SDE noise scale at t=eps (score_sde's sigma_min)
SIGMA_MAX = 5.0  # VE SDE noise scale at t=1; small because the toy data has unit scale
T_EPS = 1e-5  # score_sde samples t ~ U(eps, 1) to avoid the singular t=0
CNN_HIDDEN, CNN_DROPOUT = 64, 0.25  # the width of the CNN's dropout layer, and its rate


def no_noise(key: jax.Array, batch: dict) -> dict:
    """The MLP regression is deterministic: it consumes no random numbers."""
    del key, batch
    return {}


def score_noise(key: jax.Array, batch: dict) -> dict:
    """Random times and Gaussian noise, split exactly as score_sde's sde loss does."""
    x_shape = batch['x'].shape
    rng, step_rng = jax.random.split(key)
    t_B = jax.random.uniform(step_rng, (x_shape[0],), minval=T_EPS, maxval=1.0)
    rng, step_rng = jax.random.split(rng)
    z_BxD = jax.random.normal(step_rng, x_shape)
    return {'t': t_B, 'z': z_BxD}


def cnn_noise(key: jax.Array, batch: dict) -> dict:
    """The dropout mask of the CNN's hidden layer, the bits its Dropout would draw."""
    return {'keep': jax.random.bernoulli(key, 1.0 - CNN_DROPOUT, (batch['x'].shape[0], CNN_HIDDEN))}


def mlp_loss(model, batch: dict, noise: dict) -> jax.Array:
    """Squared error of the regression MLP, one value per example."""
    del noise
    pred_Bx1 = model(batch['x'])
    return jnp.mean((pred_Bx1 - batch['y']) ** 2, axis=-1)


def wide_loss(model, batch: dict, noise: dict) -> jax.Array:
    """Squared error of the wide MLP's 8 outputs, one value per example."""
    del noise
    return jnp.mean((model(batch['x']) - batch['y']) ** 2, axis=-1)


def score_loss(model, batch: dict, noise: dict) -> jax.Array:
    """Denoising score matching on the VE SDE (score_sde, reduce_mean=True, no weighting)."""
    x_BxD, t_B, z_BxD = batch['x'], noise['t'], noise['z']
    std_B = SIGMA_MIN * (SIGMA_MAX / SIGMA_MIN) ** t_B
    perturbed_BxD = x_BxD + std_B[:, None] * z_BxD
    score_BxD = model(perturbed_BxD, std_B)
    losses_BxD = jnp.square(score_BxD * std_B[:, None] + z_BxD)
    return jnp.mean(losses_BxD, axis=-1)


def cnn_loss(model, batch: dict, noise: dict) -> jax.Array:
    """Softmax cross-entropy; BatchNorm updates its running statistics in place."""
    logits_BxC = model(batch['x'], keep_mask=noise['keep'])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxC, batch['y'])


def cnn_predict(model, x_BxHxWxC: jax.Array) -> jax.Array:
    """Evaluation: running averages, no dropout."""
    return nnx.view(model, use_running_average=True)(x_BxHxWxC)
