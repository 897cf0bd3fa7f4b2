"""A new side as a linen + ``jax.jit`` migration writes it: pinned to a mesh built at import.

The module builds its mesh from ``jax.devices()`` when it is imported and the step's shardings
name it (``in_shardings``/``out_shardings``), as a benchmark's workload migrated from ``jax.pmap``
does. So the step runs on every device the process sees and on nothing else: a twin on another
device count needs a process that sees that many devices (``tests/test_twins.py``). It keeps its
parameters and optimizer state fsdp-style, split where the first dimension divides.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equivalence import LoopPort

AXIS, FEATURES, HIDDEN = 'batch', 4, 16
MESH = Mesh(np.array(jax.devices()), (AXIS,))  # at import, from every device this process sees
REPLICATED, ROWS = NamedSharding(MESH, P()), NamedSharding(MESH, P(AXIS))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(HIDDEN)(x))
        return nn.Dense(1)(h)


class NnxMLP(nnx.Module):  # only carries linen's weights across; the new side is linen
    def __init__(self, rngs: nnx.Rngs):
        self.Dense_0, self.Dense_1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, 1, rngs=rngs)


def make_data(rng, n_steps, batch):
    x = rng.normal(size=(n_steps, batch, FEATURES)).astype(np.float32)
    return {'x': x, 'y': np.sin(x.sum(-1, keepdims=True)).astype(np.float32)}


def tx(lr=1e-2):
    return optax.adam(lr)


def loss_fn(params, batch):
    return jnp.mean((MLP().apply({'params': params}, batch['x']) - batch['y']) ** 2)


def legacy_state(variables):
    return train_state.TrainState.create(apply_fn=MLP().apply, params=variables['params'], tx=tx())


def pmap_step(state, batch):
    """The pmap-era step: this device's gradient, pmean'd."""
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=jax.lax.pmean(grads, AXIS)), jax.lax.pmean(loss, AXIS)


def fsdp(tree):
    """Each leaf split over the mesh on its first dimension where that divides, fsdp-style, else replicated."""
    n = MESH.size
    return jax.tree.map(lambda a: ROWS if a.ndim and a.shape[0] % n == 0 else REPLICATED, tree)


def make_jit_step(optimizer):
    def step(state, batch):
        """The same step under jax.jit on the global batch: a dict of linen params and optax state, which
        it keeps fsdp-style (``fsdp``), as a migrated workload that fits only sharded does."""
        loss, grads = jax.value_and_grad(loss_fn)(state['params'], batch)
        updates, opt_state = optimizer.update(grads, state['opt_state'], state['params'])
        new = {'params': optax.apply_updates(state['params'], updates), 'opt_state': opt_state}
        return jax.lax.with_sharding_constraint(new, fsdp(new)), loss

    return jax.jit(step, in_shardings=(None, ROWS), out_shardings=(None, REPLICATED))


class Holder(nnx.Module):
    """The new side's dict of linen params and optax state, held where the suite reads an NNX train state."""

    def __init__(self, state: dict):
        self.state = nnx.Variable(state)


def new_state(model, optimizer) -> Holder:
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return Holder({'params': params, 'opt_state': optimizer.init(params)})


def held(jit_step):
    def step(holder: Holder, batch):
        state, loss = jit_step(holder.state.get_value(), batch)
        holder.state.set_value(state)
        return loss

    return step


PORT = LoopPort(
    name='pinned-linen-jit',
    legacy_model=MLP,
    nnx_model=lambda rngs: NnxMLP(rngs),
    make_data=make_data,
    legacy_state=legacy_state,
    legacy_step=pmap_step,
    step_form='state',
    new_state=lambda model: new_state(model, tx()),
    new_step=held(make_jit_step(tx())),
    new_groups=lambda holder: {k: holder.state.get_value()[k] for k in ('params', 'opt_state')},
    init_args=lambda batch: (batch['x'],),
    axis_name=AXIS,
    default_batch=16,
    rng_modes=('global',),
)
# A slip on the new side: its learning rate 1% high.
SLIP = dataclasses.replace(
    PORT,
    name='pinned-linen-jit-slip',
    new_state=lambda model: new_state(model, tx(1.01e-2)),
    new_step=held(make_jit_step(tx(1.01e-2))),
)


def make_port() -> LoopPort:
    """A factory: ``--workload pinned_port:make_port`` names it (docs/port.md: a port, or a function
    returning one), and it builds its port afresh: no attribute of this module holds it."""
    return dataclasses.replace(PORT, name='pinned-by-factory')
