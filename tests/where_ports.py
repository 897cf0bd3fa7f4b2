"""The example's loop port (``examples/mlp_port``) in the shapes issue 40 found ``where:`` wrong on, each
a one-constant difference: an EMA whose decay differs, and one whose decay is a Python float on one side
and a float32 leaf on the other; SGD momentum under a warmup whose first update is 0; a weight decay
masked to the kernels and added after the learning-rate scale; a pmap step that does not pmean its
reported loss, and one that does not pmean its gradients; NaN in the data. ``CORRECT`` is the port with
the EMA, as it should be (the negative control)."""

import dataclasses
import functools
import os
import sys
from typing import Any

import bn_bias_ports
import flax
import jax
import jax.numpy as jnp
import noisy_ports
import numpy as np
import optax
from conftest import ROOT
from flax import nnx

from equivalence import read_groups

sys.path.insert(0, os.path.join(ROOT, 'examples', 'mlp_port'))
import legacy_code as old  # noqa: E402
import my_port  # noqa: E402
import nnx_code as new  # noqa: E402

RATE = 0.99


@flax.struct.dataclass
class EmaState:
    step: jax.Array
    params: Any
    opt_state: Any
    ema_params: Any  # read by name as the EMA


def legacy_tx(momentum: float | None = None, warmup: bool = False, peak: float = 3e-2):
    lr = optax.linear_schedule(0.0, peak, 4) if warmup else 3e-3
    return optax.sgd(lr, momentum=momentum) if momentum is not None else old.make_tx()


def pmap_step(tx, rate=RATE, pmean_loss=True, pmean_grads=True):
    """The example's ``pmap(scan(train_step))`` with an EMA at ``rate`` (a float32 leaf of the state's
    arithmetic), and its two pmeans, each optional."""

    def train_step(carry, batch):
        rng, state = carry
        rng, step_rng = jax.random.split(rng)
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(old.per_example_loss(p, batch, step_rng)))(state.params)
        grads = jax.lax.pmean(grads, axis_name=old.AXIS) if pmean_grads else grads
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        r = jnp.float32(rate)
        ema = jax.tree.map(lambda e, p: e * r + p * (1 - r), state.ema_params, params)
        state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, ema_params=ema)
        return (rng, state), (jax.lax.pmean(loss, axis_name=old.AXIS) if pmean_loss else loss)

    return jax.pmap(functools.partial(jax.lax.scan, train_step), axis_name=old.AXIS, donate_argnums=1)


def legacy_state(tx):
    def create(variables: dict) -> EmaState:
        params = variables['params']
        return EmaState(jnp.zeros((), jnp.int32), params, tx.init(params), jax.tree.map(jnp.copy, params))

    return create


class TrainState(nnx.Module):
    def __init__(self, model, tx):
        self.model, self.optimizer, self.ema = model, nnx.Optimizer(model, tx, wrt=nnx.Param), nnx.clone(model)


def nnx_calls(rate):
    @nnx.jit
    def calls(ts: TrainState, key, batch_KxG):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def step(carry, batch):
            ts, key = carry
            key, step_key = jax.random.split(key)
            nnx.reseed(ts.model, dropout=step_key)
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean(new.per_example_loss(m, batch)))(ts.model)
            ts.optimizer.update(ts.model, grads)
            ema = jax.tree.map(lambda e, p: e * rate + p * (1 - rate), nnx.state(ts.ema, nnx.Param),
                               nnx.state(ts.model, nnx.Param))  # fmt: skip
            nnx.update(ts.ema, ema)
            return (ts, key), loss

        return step((ts, key), batch_KxG)[1]

    return calls


def new_groups(ts: TrainState) -> dict:
    """The default reading of (model, optimizer), through the public ``read_groups`` (docs/port.md), and the EMA."""
    return {**read_groups((ts.model, ts.optimizer)), 'ema': nnx.to_pure_dict(nnx.state(ts.ema, nnx.Param))}


def port(name: str, tx=None, new_tx=None, rate=RATE, new_rate=None, **legacy) -> Any:
    tx = tx or legacy_tx()
    calls = nnx_calls(jnp.float32(rate) if new_rate is None else new_rate)
    return dataclasses.replace(
        my_port.LOOP, name=name, legacy_state=legacy_state(tx), legacy_step=pmap_step(tx, rate, **legacy),
        new_state=lambda model: TrainState(model, new_tx or tx),
        new_call=lambda ts, key, batch: (ts, calls(ts, key, batch)), new_groups=new_groups,
    )  # fmt: skip


def nan_data(rng: np.random.Generator, n_steps: int, batch: int):
    x, y = old.make_data(rng, n_steps, batch)
    x[3, 0, 0] = np.nan  # step 4's first example
    return x, y


def decayed_after_lr(lr=3e-3, decay=1e-2):
    """AdamW's decay written as optax users write it after the learning-rate scale, masked to kernels."""
    kernels = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    return optax.chain(optax.scale_by_adam(), optax.scale(-lr), optax.add_decayed_weights(-decay * 1.0, kernels))


# Held to the device-count twins' floor (``--twin devices``): the Python float's EMA parts by 9 spacings of its
# largest leaf, which the device-count twin holds to 8 (its EMA is bitwise the run's: a floor of 0); the run's own
# program from batches one spacing off moves the EMA by one spacing, so it allows 10 and calls it a MATCH.
DEVICE_TWIN = {'ema-python-float'}
CORRECT = port('ema-correct')
PORTS = {
    'correct': CORRECT,
    'ema-rate': port('ema-rate', new_rate=jnp.float32(0.9)),
    'ema-python-float': port('ema-python-float', new_rate=RATE),  # a Python float against a float32 leaf
    'momentum-under-warmup': port('momentum', tx=legacy_tx(0.9, warmup=True), new_tx=legacy_tx(0.95, warmup=True)),
    'lr-under-warmup': port('lr', tx=legacy_tx(0.9, warmup=True), new_tx=legacy_tx(0.9, warmup=True, peak=0.3)),
    'decay-after-lr': port(
        'decay', tx=optax.chain(optax.scale_by_adam(), optax.scale(-3e-3)), new_tx=decayed_after_lr()
    ),
    'loss-not-pmeaned': port('loss-not-pmeaned', pmean_loss=False),
    'grads-not-pmeaned': port('grads-not-pmeaned', pmean_grads=False),
    'nan-data': dataclasses.replace(CORRECT, name='nan-data', make_data=nan_data),
    # noisy inputs drawn from each device's key (noisy_ports): correct, a key derived otherwise, the examples
    # laid out over the devices otherwise
    'noise-correct': noisy_ports.PER_DEVICE,
    'noise-key-folded': dataclasses.replace(noisy_ports.PER_DEVICE, name='folded', new_step=noisy_ports.new_step(1)),
    'noise-rows-interleaved': dataclasses.replace(
        noisy_ports.PER_DEVICE, name='interleaved', new_step=noisy_ports.new_step(interleaved=True)
    ),
    # a new user's conv net with a bias before each BatchNorm (bn_bias_ports): its noise-dominated biases
    'bn-bias-warmup': bn_bias_ports.port('bn-bias-warmup', warmup=4),
    'bn-bias-clip': bn_bias_ports.port('bn-bias-clip', clip=0.5),
}
