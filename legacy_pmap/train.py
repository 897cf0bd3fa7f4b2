"""One training step, and K of them fused over devices with ``jax.pmap(lax.scan(step))``.

The pattern of score_sde's run_lib.py / losses.py, ported from ``flax.optim`` to optax:
the per-device gradient is averaged with an explicit ``lax.pmean`` before the update,
the reported loss too; the state is replicated (one copy per device) and read back from
replica 0. ``nnx_sharded/train.py`` mirrors this file function by function.
"""

import functools
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = 'batch'  # the pmap axis; every collective below names it
RNG_MODES = ('per-device', 'global')


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # updates applied so far; score_sde's lr warmup reads it before +1
    params: Any
    opt_state: optax.OptState
    model_state: Any  # mutable collections (batch_stats); never pmean'd, as in score_sde
    params_ema: Any  # None when the workload keeps no EMA


def create_state(variables: dict, tx: optax.GradientTransformation, ema_rate: float | None) -> TrainState:
    """The single-device train state, before replication."""
    params = variables['params']
    model_state = {k: v for k, v in variables.items() if k != 'params'}
    ema = jax.tree.map(_copy, params) if ema_rate is not None else None
    zero = np.zeros((), np.int32)
    return TrainState(step=zero, params=params, opt_state=tx.init(params), model_state=model_state, params_ema=ema)


def _copy(x):
    """A copy made on the host, which compiles nothing (``jnp.copy`` compiles one program per shape);
    a traced array (the pre-flight traces this) is copied as JAX does."""
    return jnp.copy(x) if isinstance(x, jax.core.Tracer) else np.array(x)


def batch_spec(batch, n: int):
    """Shapes and dtypes of a batch of ``n`` examples shaped as ``batch``: what a noise function reads."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype), batch)


def draw_noise(noise_fn: Callable, key: jax.Array, batch, rng_mode: str, axis_name: str = AXIS) -> dict:
    """This device's random numbers: drawn for its own batch, or cut from a global draw.

    ``noise_fn(key, spec)`` gets the shapes of the batch it draws for (``batch_spec``).
    """
    b = jax.tree.leaves(batch)[0].shape[0]
    if rng_mode == 'per-device':
        return noise_fn(key, batch_spec(batch, b))
    n_dev = jax.lax.psum(1, axis_name)
    noise_G = noise_fn(key, batch_spec(batch, n_dev * b))  # same key on every device
    start = jax.lax.axis_index(axis_name) * b
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, b), noise_G)


def batch_mean(losses_B) -> jax.Array:
    """This device's share of the loss, whose ``pmean`` is the global batch's: per-example losses'
    mean, or for a weighted loss ``{'loss': sums_B, 'weight': weights_B}`` (token sums and token
    counts) ``sum(loss) / psum(sum(weight)) * D``, so that pmean gives ``psum(sums) / psum(weights)``."""
    if not isinstance(losses_B, dict):
        return jnp.mean(losses_B)
    weight = jax.lax.psum(jnp.sum(losses_B['weight']), axis_name=AXIS)
    return jnp.sum(losses_B['loss']) / weight * jax.lax.psum(1, AXIS)


def make_step_fn(
    model, per_example_loss: Callable, noise_fn: Callable, tx, ema_rate, rng_mode: str, draw: Callable | None = None
) -> Callable:
    """``step((rng, state), batch) -> ((rng, state), loss)``, the body of the scan. ``draw(rng, batch)
    -> (rng, noise)``: how a step splits its key and draws its numbers, if not as ``rng_mode`` says."""

    def split_and_draw(rng, batch):
        rng, step_rng = jax.random.split(rng)
        return rng, draw_noise(noise_fn, step_rng, batch, rng_mode)

    draw = draw or split_and_draw

    def loss_fn(params, model_state, batch, noise):
        losses_B, new_model_state = per_example_loss(model, params, model_state, batch, noise)
        return batch_mean(losses_B), new_model_state

    def step(carry, batch):
        rng, state = carry
        rng, noise = draw(rng, batch)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, model_state), grads = grad_fn(state.params, state.model_state, batch, noise)
        grads = jax.lax.pmean(grads, axis_name=AXIS)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ema = state.params_ema
        if ema_rate is not None:
            ema = jax.tree.map(lambda e, p: e * ema_rate + p * (1.0 - ema_rate), ema, params)
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state, params_ema=ema
        )
        loss = jax.lax.pmean(loss, axis_name=AXIS)
        return (rng, new_state), loss

    return step


def make_fused_call(step_fn: Callable, devices, axis_name: str = AXIS) -> Callable:
    """K steps per call on every device: ``p_train_step((rng, state), batch_DxK)``.

    As score_sde: argument 1, the batch, is donated (not the state).
    """
    scan = functools.partial(jax.lax.scan, step_fn)
    return jax.pmap(scan, axis_name=axis_name, donate_argnums=1, devices=devices)


def next_call_keys(rng: jax.Array, n_devices: int, rng_mode: str) -> tuple[jax.Array, jax.Array]:
    """Host-side keys for one call: ``[n_devices, 2]``, one row per device.

    per-device: score_sde's ``rng, *next_rng = random.split(rng, n + 1)``.
    global: one key for the global batch, the same on every device.
    """
    if rng_mode == 'per-device':
        rng, *next_rng = jax.random.split(rng, n_devices + 1)
        return rng, jnp.asarray(next_rng)
    rng, call_rng = jax.random.split(rng)
    return rng, jnp.broadcast_to(call_rng, (n_devices, *call_rng.shape))


def shard_batch(x_KxGx: np.ndarray, n_devices: int) -> np.ndarray:
    """``[K, G, ...] -> [D, K, G/D, ...]``: device d gets rows d*B:(d+1)*B of each step."""
    k, g = x_KxGx.shape[:2]
    x_KxDxBx = x_KxGx.reshape(k, n_devices, g // n_devices, *x_KxGx.shape[2:])
    return np.swapaxes(x_KxDxBx, 0, 1)


def replicate(state: TrainState, devices, axis_name: str = AXIS) -> TrainState:
    """One copy of the state per device, as ``flax.jax_utils.replicate`` always did, placed where
    the pmapped step puts its outputs: on a mesh over ``devices`` whose one axis is ``axis_name``.

    Why not flax's placement as it is: today's ``jax.pmap`` is a ``jit`` whose cache key holds the
    inputs' meshes, and flax names its mesh's axis ``_device_put_sharded``. The first call, fed
    flax's placement, and the second, fed the first's outputs, then compile the same program twice
    (measured: every legacy run compiled its step twice, 3.2 s of a Transformer check's 26 s). Same
    values on the same devices; only the name changes. With several processes the pmap spans
    every process's devices, and the state stays as flax places it."""
    if jax.process_count() > 1:
        return flax.jax_utils.replicate(state, devices)
    placed = NamedSharding(Mesh(np.asarray(devices), (axis_name,)), P(axis_name))
    return jax.tree.map(lambda x: _copies(x, devices, placed), state)


def _copies(x, devices, placed: NamedSharding) -> jax.Array:
    """Copies of ``x`` stacked and placed one per device of ``devices``, sent from the host: flax's
    stacking on device compiles two small programs per leaf shape (seconds in a fresh process), this none."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.device_put(flax.jax_utils.replicate(x, devices), placed)  # a typed key has no host form
    host = np.asarray(x)
    host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)  # a Python int: int32, as JAX has it
    return jax.device_put(np.broadcast_to(host[None], (len(devices), *host.shape)), placed)


def unreplicate(tree):
    """Replica 0 of every leaf, read from device 0's shard.

    Old code wrote ``x[0]`` (the old ``flax.jax_utils.unreplicate``). Today a pmap output
    is a global ``jax.Array`` and ``x[0]`` is a compiled gather; reading the first shard
    moves nothing. (flax 0.12's ``unreplicate`` does this too, but returns ``[1, ...]``
    instead of ``[...]`` when pmap ran on one device of several.)
    """
    return jax.tree.map(_replica0, tree)


def unreplicate_to_host(tree):
    """Replica 0 of every leaf as a host array (``unreplicate`` then ``np.asarray``), with no program
    compiled for it: indexing a shard on device compiles one per leaf shape. A typed key
    (``jax.random.key``) has no host form: its key data, as a raw ``PRNGKey`` is held."""
    return jax.tree.map(lambda x: np.asarray(_key_data(_shard0(x)))[0], tree)


def _key_data(x: jax.Array) -> jax.Array:
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _shard0(x: jax.Array) -> jax.Array:
    return next(s for s in x.addressable_shards if s.index[0].start in (0, None)).data


def _replica0(x: jax.Array) -> jax.Array:
    return _shard0(x)[0]
