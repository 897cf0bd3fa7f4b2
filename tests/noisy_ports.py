"""A loop port whose steps draw noisy inputs from each device's key (``PER_DEVICE``): the twins' tests
(``test_twins``) and the location's of random draws (``test_where``), with its slips."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from equivalence import LoopPort

AXIS, FEATURES, HIDDEN, NOISE = 'batch', 4, 8, 0.3
QUICK = {'steps_per_call': 2, 'calls': 2}


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(HIDDEN)(x))
        return nn.Dense(1, kernel_init=nn.initializers.zeros)(h)  # a zero-initialised head


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.Dense_0, self.Dense_1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, 1, rngs=rngs)

    def __call__(self, x):
        return self.Dense_1(jnp.tanh(self.Dense_0(x)))


def make_data(rng, n_steps, batch):
    x = rng.normal(size=(n_steps, batch, FEATURES)).astype(np.float32)
    return {'x': x, 'y': np.cos(x.sum(-1, keepdims=True)).astype(np.float32)}


def tx():
    """The first update's learning rate is 0 (warmup): with the zero head, the first two losses are the
    same whatever noise the step draws."""
    return optax.sgd(optax.linear_schedule(0.0, 0.1, 10), momentum=0.9)


def pmap_step(state, batch, rng):
    """Noisy inputs drawn from this device's key."""
    x = batch['x'] + NOISE * jax.random.normal(rng, batch['x'].shape)
    loss_fn = lambda p: jnp.mean((state.apply_fn({'params': p}, x) - batch['y']) ** 2)  # noqa: E731
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=jax.lax.pmean(grads, AXIS)), jax.lax.pmean(loss, AXIS)


def new_step(fold: int | None = None, interleaved: bool = False):
    """The same noise from the ``[D, 2]`` keys: device row d's rows from key d. The slips: each key folded
    with ``fold`` first (a key derived otherwise), or device d's noise given to rows d, d + D, ... (the
    examples laid out over the devices otherwise), the forward pass then vmapped over the device rows, as
    google-research/vdm's port runs it (its values recorded ``[D, B / D, ...]``)."""

    def forward(m, x, d: int):
        if not interleaved:
            return m(x)
        return nnx.vmap(lambda m, rows: m(rows), in_axes=(None, 0))(m, x.reshape(d, -1, *x.shape[1:])).reshape(
            x.shape[0], -1
        )

    @nnx.jit
    def step(ts, batch, keys):
        model, optimizer = ts
        x = batch['x']
        keys = keys if fold is None else jax.vmap(lambda k: jax.random.fold_in(k, fold))(keys)
        noise = jax.vmap(lambda k: jax.random.normal(k, (x.shape[0] // keys.shape[0], *x.shape[1:])))(keys)
        x = x + NOISE * (noise.swapaxes(0, 1) if interleaved else noise).reshape(x.shape)
        d = keys.shape[0]
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((forward(m, x, d) - batch['y']) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return step


nnx_step = new_step()


PER_DEVICE = LoopPort(
    name='per-device-noise',
    legacy_model=LinenNet,
    nnx_model=lambda rngs: NnxNet(rngs),
    make_data=make_data,
    legacy_state=lambda v: train_state.TrainState.create(apply_fn=LinenNet().apply, params=v['params'], tx=tx()),
    legacy_step=pmap_step,
    step_form='state_rng',
    new_state=lambda model: (model, nnx.Optimizer(model, tx(), wrt=nnx.Param)),
    new_step=nnx_step,
    init_args=lambda batch: (batch['x'],),
    axis_name=AXIS,
    default_batch=16,
    rng_modes=('per-device',),
)
