"""A loop port whose pmap side has float32 noise of its own, by construction: what the legacy twin is for.

The pmap step averages each device's gradient with ``offset_pmean``: before the ``psum`` device d
adds an offset ``(2d - (D - 1)) * 2**e``, and the offsets sum to exactly 0 over the devices. In
exact arithmetic that is ``lax.pmean``; in float32 each ``g + offset`` keeps only the bits of ``g``
above the offset's spacing, so the mean loses low bits of every device's gradient. On one device
the offset is 0 and the step is a plain mean: the legacy twin (this pmap step on 1 device) rounds
as the NNX runs do, which add no offset. The exponent ``e`` grows by 3 with every step
(``OFFSET_EXPONENTS``): over the first call (2 steps) the offsets are below the gradients and
cost no more than ordinary rounding; by the eighth step their spacing is about 1% of them.

So on D > 1 the pmap run, and only it, leaves the others by a spread that starts at rounding level
and grows over the calls: chaos on the pmap side that no NNX twin can see. Its size does not depend
on the CPU: it is float32 addition of a value to a larger multiple of a power of two (IEEE 754,
whatever the instruction set); the order in which XLA sums the devices changes its bits, not its
size. What is left to the machine is the ordinary rounding of a 64-example mean, a few spacings.

``PORT`` is the correct port (both sides halve the learning rate at step ``DECAY_AT``);
``LATE_DECAY_SLIP`` the same port whose NNX side halves it one step late, a slip that shows only
after the first call.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from equivalence import LoopPort

AXIS, FEATURES = 'batch', 16
LR, DECAY_AT = 0.1, 4  # SGD; the learning rate halves from step DECAY_AT (0-based) on
# The offset's power of two at each step (0-based): 2**-8 and 2**-5 over the first call, below the
# gradients (~0.1-1); 2**13 at the eighth step, whose largest offset, 7 * 2**13, has a spacing of 3.9e-3.
OFFSET_EXPONENTS = tuple(3 * k - 8 for k in range(8))


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        return nn.Dense(1, use_bias=False)(x_BxF)


class NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.Dense_0 = nnx.Linear(FEATURES, 1, use_bias=False, rngs=rngs)

    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        return self.Dense_0(x_BxF)


def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict[str, np.ndarray]:
    """A noisy linear teacher: ``{'x': [n_steps, batch, F], 'y': [n_steps, batch, 1]}``."""
    w = rng.normal(size=(FEATURES, 1))
    x = rng.normal(size=(n_steps, batch, FEATURES)).astype(np.float32)
    return {'x': x, 'y': (x @ w + 0.1 * rng.normal(size=(n_steps, batch, 1))).astype(np.float32)}


def make_tx(decay_at: int = DECAY_AT) -> optax.GradientTransformation:
    return optax.sgd(optax.piecewise_constant_schedule(LR, {decay_at: 0.5}))


def mse(pred: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((pred - y) ** 2)


def offset_pmean(g: jax.Array, step: jax.Array) -> jax.Array:
    """``lax.pmean(g)`` in exact arithmetic; in float32 it drops the bits of each device's ``g`` below
    the spacing of its offset (none on one device, whose offset is 0)."""
    d, n = jax.lax.axis_index(AXIS), jax.lax.axis_size(AXIS)
    scale = jnp.asarray(OFFSET_EXPONENTS, jnp.int32)[jnp.minimum(step, len(OFFSET_EXPONENTS) - 1)]
    offset = jnp.ldexp(jnp.float32(2 * d - (n - 1)), scale)  # exact: a small integer times a power of 2
    return jax.lax.psum(g + offset, AXIS) / n


def legacy_state(variables: dict) -> train_state.TrainState:
    return train_state.TrainState.create(apply_fn=LinenModel().apply, params=variables['params'], tx=make_tx())


def legacy_step(carry: tuple, batch: dict) -> tuple:
    """score_sde's form: ``((rng, state), batch) -> ((rng, state), loss)``, with the offset pmean."""
    rng, state = carry
    loss_fn = lambda params: mse(state.apply_fn({'params': params}, batch['x']), batch['y'])  # noqa: E731
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = jax.tree.map(lambda g: offset_pmean(g, state.step), grads)
    return (rng, state.apply_gradients(grads=grads)), jax.lax.pmean(loss, AXIS)


def nnx_state(model: NnxModel, decay_at: int = DECAY_AT) -> tuple:
    return model, nnx.Optimizer(model, make_tx(decay_at), wrt=nnx.Param)


@nnx.jit
def train_calls(model: NnxModel, optimizer: nnx.Optimizer, batch_KxG: dict) -> jax.Array:
    """K steps of SGD on the global batch in one compiled call; each step's loss."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def step(ts, batch):
        model, optimizer = ts
        loss, grads = nnx.value_and_grad(lambda m: mse(m(batch['x']), batch['y']))(model)
        optimizer.update(model, grads)
        return ts, loss

    return step((model, optimizer), batch_KxG)[1]


def nnx_call(train_state_: tuple, key: jax.Array, batch_KxG: dict) -> tuple:
    """The suite's fused call; ``key`` is not used (nothing here is random)."""
    return train_state_, train_calls(*train_state_, batch_KxG)


PORT = LoopPort(
    name='pmap-side-chaos',
    legacy_model=LinenModel,
    nnx_model=NnxModel,
    make_data=make_data,
    legacy_state=legacy_state,
    legacy_step=legacy_step,
    new_state=nnx_state,
    new_call=nnx_call,
    init_args=lambda batch: (batch['x'],),
    axis_name=AXIS,
    rng_modes=('global',),
    summary="SGD on a linear model; the pmap side's gradient mean rounds more as training goes",
)

LATE_DECAY_SLIP = dataclasses.replace(
    PORT, name='pmap-side-chaos-late-decay', new_state=lambda model: nnx_state(model, DECAY_AT + 1)
)
