"""One training step, and K of them fused into one compiled call with a scan.

Mirrors ``legacy_pmap/train.py`` function by function. Differences, each on purpose:

- The state is one NNX object (model, optimizer, EMA); the step ``nnx.merge``s it from
  a plain nested dict of arrays (``nnx.to_pure_dict``) and turns it back into one, so
  the scan and every call carry plain arrays. A plain dict, not the ``nnx.State`` that
  ``nnx.split`` returns: ``jit`` flattens a dict in C++, while ``nnx.State`` is a Python
  pytree whose flatten and unflatten cost host time on every call (0.1 to 0.5 ms of
  dispatch per call with 8 simulated devices, measured with ``python -m equivalence.bench``;
  see docs/fast.md).
- The fused call is ``jax.jit`` of a ``lax.scan`` of the step over that split state, not
  ``nnx.jit(nnx.scan)``: graph-mode ``nnx.jit`` walks the object graph on every call
  (host time the pmap path never pays), and with plain pytrees the shardings and the
  donation of the state are ordinary ``jit`` arguments.
- No ``pmean``: the loss is the mean over the *global* batch, which is sharded, so
  XLA's partitioner inserts the all-reduce of the gradients itself.
- The gradient comes from ``sharding.value_and_grad``: under data parallelism the dot layers'
  kernels are placed *reduced* over the data axis while it is formed, so the all-reduce runs
  after each kernel gradient's transpose, where pmap's ``pmean`` is, and XLA folds the
  transpose into the dot. Otherwise the partitioner all-reduces the dot's output and the
  transpose stays behind it as copies: 6 per step on ``wide``, 16 on ``score`` (read from the
  compiled HLO, ``python -m equivalence.bench``).
- The step returns its per-example losses, and the fused call averages them after the
  scan: one all-reduce of K numbers per call, where pmap's ``pmean(loss)`` adds one
  operand to the all-reduce of every step. On CPU each all-reduce operand is one
  rendezvous of all devices, the most expensive op of a step with 8 simulated devices
  (measured with ``python -m equivalence.bench``; see docs/fast.md).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nnx_sharded import sharding

RNG_MODES = ('per-device', 'global')


class TrainState(nnx.Module):
    """Model, optimizer (its ``step`` counts updates) and an optional EMA copy."""

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, ema_rate: float | None):
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        self.ema = nnx.clone(model) if ema_rate is not None else None


def create_state(model: nnx.Module, tx: optax.GradientTransformation, ema_rate: float | None):
    """``(graphdef, state)``: the static structure, and the arrays the scan carries (a plain dict)."""
    graphdef, state = nnx.split(TrainState(model, tx, ema_rate))
    return graphdef, nnx.to_pure_dict(state)


def split_keys(rng: jax.Array, rng_mode: str) -> tuple[jax.Array, jax.Array]:
    """``rng, step_rng = split(rng)``, once per device row in per-device mode."""
    pair = jax.vmap(jax.random.split)(rng) if rng_mode == 'per-device' else jax.random.split(rng)
    return (pair[:, 0], pair[:, 1]) if rng_mode == 'per-device' else (pair[0], pair[1])


def batch_spec(batch, n: int):
    """Shapes and dtypes of a batch of ``n`` examples shaped as ``batch``: what a noise function reads."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype), batch)


def draw_noise(noise_fn: Callable, key: jax.Array, batch, rng_mode: str) -> dict:
    """The step's random numbers for the global batch; ``noise_fn(key, spec)`` as on the pmap side.

    per-device: ``key`` is ``[D, 2]``. View the global batch as ``[D, G/D]`` and vmap
    the per-device draw over D: row d gets exactly the numbers pmap device d draws.
    global: one draw of the global shape.
    """
    g = jax.tree.leaves(batch)[0].shape[0]
    if rng_mode == 'global':
        return noise_fn(key, batch_spec(batch, g))
    n_dev = key.shape[0]
    noise_DxB = jax.vmap(lambda k: noise_fn(k, batch_spec(batch, g // n_dev)))(key)
    return jax.tree.map(lambda a: a.reshape(g, *a.shape[2:]), noise_DxB)


def batch_mean(losses_G) -> tuple[jax.Array, jax.Array]:
    """The global batch's loss, and per-example values whose mean it is (averaged after the scan):
    per-example losses as they are, or for a weighted loss ``{'loss': sums_G, 'weight': weights_G}``
    ``sum(loss) / sum(weight)``, and ``loss * G / sum(weight)`` per example."""
    if not isinstance(losses_G, dict):
        return jnp.mean(losses_G), losses_G
    weight, g = jnp.sum(losses_G['weight']), losses_G['loss'].shape[0]
    return jnp.sum(losses_G['loss']) / weight, losses_G['loss'] * g / weight


def make_update_fn(per_example_loss: Callable, noise_fn: Callable, ema_rate, rng_mode: str) -> Callable:
    """``update(ts, rng, batch) -> (rng, losses_G)``: one step on the TrainState object, in place.

    The step of both NNX forms: ``make_step_fn`` wraps it in split state for ``jax.jit``,
    ``make_graph_call`` runs it on the object under ``nnx.jit(nnx.scan)``.
    """

    def loss_fn(model, batch, noise):
        return batch_mean(per_example_loss(model, batch, noise))  # global mean: no pmean

    def update(ts: TrainState, rng, batch):
        rng, step_rng = split_keys(rng, rng_mode)
        noise = draw_noise(noise_fn, step_rng, batch, rng_mode)
        (_, losses_G), grads = sharding.value_and_grad(loss_fn)(ts.model, batch, noise)  # all-reduce placed
        ts.optimizer.update(ts.model, grads)
        if ema_rate is not None:
            ema, new = nnx.state(ts.ema, nnx.Param), nnx.state(ts.model, nnx.Param)
            nnx.update(ts.ema, jax.tree.map(lambda e, p: e * ema_rate + p * (1.0 - ema_rate), ema, new))
        return rng, losses_G

    return update


def make_step_fn(graphdef, per_example_loss: Callable, noise_fn: Callable, ema_rate, rng_mode: str) -> Callable:
    """``step((rng, state), batch) -> ((rng, state), losses_G)``, the body of the scan."""
    update = make_update_fn(per_example_loss, noise_fn, ema_rate, rng_mode)

    def step(carry, batch):
        rng, state = carry
        ts = nnx.merge(graphdef, state)
        rng, losses_G = update(ts, rng, batch)
        return (rng, nnx.to_pure_dict(nnx.state(ts))), losses_G  # averaged after the scan

    return step


def scan_steps(step_fn: Callable) -> Callable:
    """``((rng, state), batch_KxG) -> ((rng, state), loss_K)``: K steps, then each step's mean loss.

    The mean over the global batch comes after the loop, so the loss costs one all-reduce
    per call instead of one per step (see the module docstring).
    """

    def fused(carry, batch_KxG):
        carry, losses_KxG = jax.lax.scan(step_fn, carry, batch_KxG)
        return carry, jnp.mean(losses_KxG, axis=1)

    return fused


def make_fused_call(step_fn: Callable, carry_shardings) -> Callable:
    """K steps in one compiled call: ``fused((rng, state), batch_KxG)``.

    The carry (keys and state) is donated, so XLA updates parameters in place; its
    output placement is pinned to the input's so that calls chain without resharding.
    """
    return jax.jit(scan_steps(step_fn), donate_argnums=0, out_shardings=(carry_shardings, None))


def make_graph_call(update: Callable) -> Callable:
    """The form of the Flax docs: ``nnx.jit(nnx.scan(..., in_axes=(nnx.Carry, 0)))`` over the
    TrainState *object*: ``fused(ts, keys, batch_KxG) -> (keys, loss_K)``, ``ts`` updated in place.

    Same arithmetic as ``make_fused_call``; what differs is host work: ``nnx.jit`` walks the
    object graph on every call (see the module docstring and docs/fast.md).
    """

    @nnx.jit(donate_argnums=0)
    def fused(ts: TrainState, keys, batch_KxG):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def body(carry, batch):
            ts, rng = carry
            rng, losses_G = update(ts, rng, batch)
            return (ts, rng), losses_G

        (_, rng), losses_KxG = body((ts, keys), batch_KxG)
        return rng, jnp.mean(losses_KxG, axis=1)

    return fused


def next_call_keys(rng: jax.Array, n_devices: int, rng_mode: str) -> tuple[jax.Array, jax.Array]:
    """Host-side keys for one call.

    per-device: ``[n_devices, 2]``, the same split as score_sde's pmap loop, so row d
    reproduces device d's stream. global: a single key for the global batch.
    """
    if rng_mode == 'per-device':
        rng, *next_rng = jax.random.split(rng, n_devices + 1)
        return rng, jnp.asarray(next_rng)
    rng, call_rng = jax.random.split(rng)
    return rng, call_rng
