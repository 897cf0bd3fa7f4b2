"""A team's pmap-era training code, as it stands before the port (not part of the suite).

linen with auto-named submodules (``Dense_0``, ``LayerNorm_0``, ``Dense_1``), dropout inside
the model, AdamW, and the score_sde loop: ``pmap(scan(train_step))`` with an explicit
``lax.pmean``. The batch is a tuple ``(x, y)``.
"""

import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

AXIS = 'batch'  # the pmap axis every pmean names
FEATURES, HIDDEN, DROPOUT = 8, 32, 0.1


class MLP(nn.Module):
    hidden: int = HIDDEN

    @nn.compact
    def __call__(self, x_BxF: jax.Array, train: bool) -> jax.Array:
        h = nn.LayerNorm()(nn.Dense(self.hidden)(x_BxF))
        h = nn.Dropout(DROPOUT, deterministic=not train)(nn.gelu(h))
        return nn.Dense(1)(h)


def make_tx(lr_scale: float = 1.0) -> optax.GradientTransformation:
    return optax.adamw(3e-3 * lr_scale, weight_decay=1e-4)


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def create_state(variables: dict) -> TrainState:
    params = variables['params']
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=make_tx().init(params))


def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``, each ``[n_steps, batch, ...]``: a noisy random teacher."""
    w = rng.normal(size=(FEATURES, 1)) / np.sqrt(FEATURES)
    x = rng.normal(size=(n_steps, batch, FEATURES)).astype(np.float32)
    y = (np.sin(x @ w) + 0.05 * rng.normal(size=(n_steps, batch, 1))).astype(np.float32)
    return x, y


def per_example_loss(params, batch, dropout_rng) -> jax.Array:
    x, y = batch
    pred = MLP().apply({'params': params}, x, train=True, rngs={'dropout': dropout_rng})
    return jnp.mean((pred - y) ** 2, axis=-1)


def train_step(carry, batch):
    """One step on one device: this device's gradient, averaged over all with pmean."""
    rng, state = carry
    rng, step_rng = jax.random.split(rng)
    loss_fn = lambda p: jnp.mean(per_example_loss(p, batch, step_rng))  # noqa: E731
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = jax.lax.pmean(grads, axis_name=AXIS)
    updates, opt_state = make_tx().update(grads, state.opt_state, state.params)
    state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
    return (rng, state), jax.lax.pmean(loss, axis_name=AXIS)


p_train_step = jax.pmap(functools.partial(jax.lax.scan, train_step), axis_name=AXIS, donate_argnums=1)
