"""Per-example losses, and the random numbers each one consumes.

``nnx_sharded/losses.py`` mirrors this file. A loss is split in two so that both
implementations can draw *exactly* the same random numbers whatever the device layout:

- ``*_noise(key, batch)`` draws every random number one step needs for a batch shaped
  as ``batch`` (its shapes and dtypes) (pure JAX, identical on both sides);
- ``*_loss(model, params, model_state, batch, noise)`` is deterministic given the noise
  and returns one loss per example plus the updated mutable collections.
"""

import jax
import jax.numpy as jnp
import optax

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


def mlp_loss(model, params, model_state, batch: dict, noise: dict):
    """Squared error of the regression MLP, one value per example."""
    del noise
    pred_Bx1 = model.apply({'params': params}, batch['x'])
    return jnp.mean((pred_Bx1 - batch['y']) ** 2, axis=-1), model_state


def wide_loss(model, params, model_state, batch: dict, noise: dict):
    """Squared error of the wide MLP's 8 outputs, one value per example."""
    del noise
    pred_BxO = model.apply({'params': params}, batch['x'])
    return jnp.mean((pred_BxO - batch['y']) ** 2, axis=-1), model_state


def score_loss(model, params, model_state, batch: dict, noise: dict):
    """Denoising score matching on the VE SDE (score_sde, reduce_mean=True, no weighting)."""
    x_BxD, t_B, z_BxD = batch['x'], noise['t'], noise['z']
    std_B = SIGMA_MIN * (SIGMA_MAX / SIGMA_MIN) ** t_B
    perturbed_BxD = x_BxD + std_B[:, None] * z_BxD
    score_BxD = model.apply({'params': params}, perturbed_BxD, std_B)
    losses_BxD = jnp.square(score_BxD * std_B[:, None] + z_BxD)
    return jnp.mean(losses_BxD, axis=-1), model_state


def cnn_loss(model, params, model_state, batch: dict, noise: dict):
    """Softmax cross-entropy; BatchNorm's running statistics come back as the new model state."""
    variables = {'params': params, **model_state}
    logits_BxC, new_model_state = model.apply(
        variables, batch['x'], train=True, keep_mask=noise['keep'], mutable=['batch_stats']
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxC, batch['y']), new_model_state


def cnn_predict(model, params, model_state, x_BxHxWxC: jax.Array) -> jax.Array:
    """Evaluation: running averages, no dropout."""
    return model.apply({'params': params, **model_state}, x_BxHxWxC, train=False)
