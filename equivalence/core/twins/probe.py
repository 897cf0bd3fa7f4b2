"""The first step, before any optimizer has amplified anything: loss, gradients, parameters after it.

A model port's first step is computed once more on each side, outside the fused loops: the
same initial state, the first batch and the first call's keys, drawn as each loop draws them.
What this returns is compared by ``verdict``: a slip in the forward or backward pass shows in
the loss and gradients here even when twenty steps of Adam hide it in the parameters, and an
optimizer slip shows in the parameters after one update while the gradients agree.

Three small programs (one step each, no scan): legacy under pmap, NNX on the checked mesh,
NNX on the twin's mesh. A loop port's step is the user's own code and has no loss function to
differentiate: its first-step check is on the losses of the runs alone.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from equivalence.core.port.config import RunConfig
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import ModelPort
from equivalence.core.run import facts, setups
from equivalence.core.run.inputs import Inputs
from equivalence.core.run.model_side import reordered_loss
from equivalence.core.state import convert
from legacy_pmap import train as legacy
from nnx_sharded import sharding
from nnx_sharded import train as sharded


@dataclasses.dataclass(frozen=True)
class FirstStep:
    """One side's first step, leaves named as NNX names them."""

    loss: float  # the mean loss over the global batch
    grads: dict[str, np.ndarray]  # the gradient the optimizer is given (pmap: after the pmean)
    params: dict[str, np.ndarray]  # the parameters after the first update


def first_batch(batch_KxG):
    """The first step's global batch ``[1, G, ...]`` of the first call (a scan of one step)."""
    return jax.tree.map(lambda v: v[:1], batch_KxG)


def legacy_first_step(port: ModelPort, config: Run, variables: dict, batch_KxG, rng, mapping) -> FirstStep:
    """The pmap step's first step (``legacy_pmap.train.make_step_fn``), its gradient kept."""
    tx, mode = port.make_tx(1.0), config.rng_mode
    noise_fn, loss = setups.port_noise(port, facts.uses_dropout(port)), setups.legacy_loss(port, config)
    model, devices = port.legacy_model(), jax.devices()[: config.devices]

    def step(key, state, batch):
        _, step_rng = jax.random.split(key)
        batch = jax.tree.map(lambda v: v[0], batch)
        noise = legacy.draw_noise(noise_fn, step_rng, batch, mode)

        def mean_loss(params):
            return jnp.mean(loss(model, params, state.model_state, batch, noise)[0])

        value, grads = jax.value_and_grad(mean_loss)(state.params)
        grads = jax.lax.pmean(grads, legacy.AXIS)
        updates, _ = tx.update(grads, state.opt_state, state.params)
        return jax.lax.pmean(value, legacy.AXIS), grads, optax.apply_updates(state.params, updates)

    pstate = legacy.replicate(legacy.create_state(variables, tx, port.ema_rate), devices)
    _, keys_D = legacy.next_call_keys(rng, config.devices, mode)
    batch = jax.tree.map(lambda v: legacy.shard_batch(v, config.devices), first_batch(batch_KxG))
    value, grads, params = jax.pmap(step, axis_name=legacy.AXIS, devices=devices)(keys_D, pstate, batch)
    named = lambda tree: convert.rename({'p': convert.flatten(legacy.unreplicate_to_host(tree))}, mapping)['p']  # noqa: E731
    return FirstStep(float(legacy.unreplicate_to_host(value)), named(grads), named(params))


def nnx_first_step(setup: setups.NnxSetup, port: ModelPort, batch_KxG, rng) -> FirstStep:
    """The NNX step's first step (``nnx_sharded.train.make_update_fn``) on ``setup``'s mesh and state."""
    mode, graphdef = setup.config.rng_mode, setup.graphdef
    noise_fn, loss = setups.port_noise(port, facts.uses_dropout(port)), setups.nnx_loss(port, setup.config)
    rows = getattr(setup, 'rows', None)  # a twin that takes the batch's rows in another order
    if rows is not None:
        loss, batch_KxG = reordered_loss(loss, rows), jax.tree.map(lambda v: np.asarray(v)[:, rows], batch_KxG)

    def step(keys, state, batch_KxG):
        ts, batch = nnx.merge(graphdef, state), jax.tree.map(lambda v: v[0], batch_KxG)
        _, step_rng = sharded.split_keys(keys, mode)
        noise = sharded.draw_noise(noise_fn, step_rng, batch, mode)
        value, grads = nnx.value_and_grad(lambda m: jnp.mean(loss(m, batch, noise)))(ts.model)
        ts.optimizer.update(ts.model, grads)
        return value, nnx.to_pure_dict(grads), nnx.to_pure_dict(nnx.state(ts.model, nnx.Param))

    _, keys = sharded.next_call_keys(rng, setup.config.devices, mode)
    keys = sharding.put(keys, sharding.replicated(setup.mesh))
    value, grads, params = jax.jit(step)(keys, setup.state, sharding.place_batch(first_batch(batch_KxG), setup.mesh))
    return FirstStep(float(value), convert.flatten(grads), convert.flatten(params))


def probe_config(config: Run) -> RunConfig:
    """The checked run's placement, in the split form (the graph form computes the same); shard_map's
    per-device program is probed as the global one it must equal."""
    strategy = 'dp' if config.strategy == 'shard_map' else config.strategy
    return dataclasses.replace(config, nnx_form='split', strategy=strategy)


def first_steps(kind: Kind, config: Run, inputs: Inputs, twin_setup=None) -> dict:
    """``{'legacy', 'new', 'twin'}`` -> ``FirstStep`` of a model port (``kinds.model.Model``); ``twin_setup``
    is a fresh twin (``kind.twin_setup``); without one, 'twin' is the NNX side's own step (a floor of 0:
    only the ulp minimum applies)."""
    port, variables, calls, rng, mapping = kind.port, inputs.variables, inputs.calls, inputs.rng, inputs.mapping
    checked = nnx_first_step(kind.new_setup(probe_config(config), inputs), port, calls[0], rng)
    return {
        'legacy': legacy_first_step(port, config, variables, calls[0], rng, mapping),
        'new': checked,
        'twin': nnx_first_step(twin_setup, port, calls[0], rng) if twin_setup is not None else checked,
    }
