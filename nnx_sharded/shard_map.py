"""The sharded path as per-device code: ``jax.shard_map`` over the mesh, with its own ``pmean``.

The port closest to pmap, for teams that want to keep per-device code: each device runs
the step on its own rows, averages the gradient and the loss over the ``data`` axis, and
applies the same update. It sits beside ``train.py``, whose step it mirrors; everything
else (the TrainState, the keys, the placement) is shared.

The trap, and how it is handled: with ``check_vma=True`` (the default), JAX tracks which
values vary across the axis. The parameters come in replicated (``P()``), so they are
*invariant*, and the gradient of an invariant value is psum'd across the axis by
autodiff itself: an explicit ``pmean`` on top would average an already-summed gradient,
giving D times the right one (pitfall 4 measures it). Here the parameters are cast to
*varying* (``lax.pcast(..., to='varying')``) before differentiating, so each device's
gradient stays its own and the explicit ``pmean`` averages it, exactly as pmap code does.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nnx_sharded.sharding import DATA
from nnx_sharded.train import batch_spec


def draw_noise(noise_fn: Callable, key: jax.Array, batch, rng_mode: str) -> dict:
    """This device's random numbers, as the pmap step draws them: from its own key, or cut
    from one global draw."""
    b = jax.tree.leaves(batch)[0].shape[0]
    if rng_mode == 'per-device':
        return noise_fn(key[0], batch_spec(batch, b))  # key: this device's row of [D, 2]
    noise_G = noise_fn(key, batch_spec(batch, jax.lax.axis_size(DATA) * b))
    start = jax.lax.axis_index(DATA) * b
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, b), noise_G)


def make_step_fn(graphdef, per_example_loss: Callable, noise_fn: Callable, ema_rate, rng_mode: str) -> Callable:
    """``step((rng, state), batch_B) -> ((rng, state), loss)`` on one device's rows, inside shard_map."""

    def loss_fn(params, model_graph, rest, batch, noise):
        losses_B = per_example_loss(nnx.merge(model_graph, params, rest), batch, noise)
        if isinstance(losses_B, dict):  # weighted: this device's share, as legacy_pmap.train.batch_mean
            weight = jax.lax.psum(jnp.sum(losses_B['weight']), axis_name=DATA)
            return jnp.sum(losses_B['loss']) / weight * jax.lax.axis_size(DATA)
        return jnp.mean(losses_B)

    def step(carry, batch):
        rng, state = carry
        ts = nnx.merge(graphdef, state)
        split = jax.vmap(jax.random.split) if rng_mode == 'per-device' else jax.random.split
        pair = split(rng)
        rng, step_rng = (pair[:, 0], pair[:, 1]) if rng_mode == 'per-device' else (pair[0], pair[1])
        noise = draw_noise(noise_fn, step_rng, batch, rng_mode)
        model_graph, params, rest = nnx.split(ts.model, nnx.Param, ...)
        varying = jax.tree.map(lambda x: jax.lax.pcast(x, DATA, to='varying'), params)  # see the docstring
        loss, grads = jax.value_and_grad(loss_fn)(varying, model_graph, rest, batch, noise)
        grads = jax.lax.pmean(grads, axis_name=DATA)
        ts.optimizer.update(ts.model, grads)
        if ema_rate is not None:
            ema, new = nnx.state(ts.ema, nnx.Param), nnx.state(ts.model, nnx.Param)
            nnx.update(ts.ema, jax.tree.map(lambda e, p: e * ema_rate + p * (1.0 - ema_rate), ema, new))
        return (rng, nnx.to_pure_dict(nnx.state(ts))), jax.lax.pmean(loss, axis_name=DATA)

    return step


def make_fused_call(step_fn: Callable, mesh: Mesh, rng_mode: str) -> Callable:
    """K steps in one compiled call, ``fused((rng, state), batch_KxG) -> ((rng, state), loss_K)``,
    the same signature as ``train.make_fused_call``: per-device code inside, one program outside."""

    def per_device(carry, batch_KxB):  # each step's loss is already pmean'd: nothing to average after
        return jax.lax.scan(step_fn, carry, batch_KxB)

    keys = P(DATA) if rng_mode == 'per-device' else P()
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=((keys, P()), P(None, DATA)), out_specs=((keys, P()), P()))
    return jax.jit(mapped, donate_argnums=0)
