"""The same team's NNX port, written as the Flax docs teach (not part of the suite).

Attributes named for what they are (``fc1``, ``norm``, ``fc2``), dropout owning its
random stream through ``nnx.Rngs``, and K steps fused by ``nnx.jit(nnx.scan)`` over the
model and optimizer objects (``train_calls``); then the same loop rewritten as the suite's
benchmark advises (``train_calls_fast``). No ``pmean``: the loss is the mean over the global batch, and
the partitioner combines the gradients.
"""

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

FEATURES, HIDDEN, DROPOUT = 8, 32, 0.1


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, epsilon: float = 1e-6, approximate_gelu: bool = True):
        self.fc1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.norm = nnx.LayerNorm(HIDDEN, epsilon=epsilon, rngs=rngs)
        self.drop = nnx.Dropout(DROPOUT, rngs=rngs)
        self.fc2 = nnx.Linear(HIDDEN, 1, rngs=rngs)
        self.approximate_gelu = approximate_gelu

    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        h = self.drop(nnx.gelu(self.norm(self.fc1(x_BxF)), approximate=self.approximate_gelu))
        return self.fc2(h)


def make_tx(lr_scale: float = 1.0) -> optax.GradientTransformation:
    return optax.adamw(3e-3 * lr_scale, weight_decay=1e-4)


def per_example_loss(model: MLP, batch) -> jax.Array:
    x, y = batch
    return jnp.mean((model(x) - y) ** 2, axis=-1)


@nnx.jit
def train_calls(model: MLP, optimizer: nnx.Optimizer, key: jax.Array, batch_KxG):
    """K steps in one compiled call; returns each step's loss."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def step(carry, batch):
        model, optimizer, key = carry
        key, step_key = jax.random.split(key)
        nnx.reseed(model, dropout=step_key)  # this step's dropout key, as the pmap step's rngs={'dropout': ...}
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(per_example_loss(m, batch)))(model)
        optimizer.update(model, grads)
        return (model, optimizer, key), loss

    _, losses_K = step((model, optimizer, key), batch_KxG)
    return losses_K


# The same loop after the advice of `python -m equivalence.bench --workload my_port:LOOP`: the
# train state split once and carried as a plain dict of arrays (no object graph to walk, no
# nnx.State to flatten on every call), `jax.jit(lax.scan)` over it with the state donated, and
# per-example losses averaged after the scan (no loss all-reduce in every step).
@flax.struct.dataclass
class SplitState:
    graphdef: Any = flax.struct.field(pytree_node=False)  # static: the structure of (model, optimizer)
    state: dict  # nnx.to_pure_dict of their arrays

    @property
    def model(self) -> MLP:
        return nnx.merge(self.graphdef, self.state)[0]

    @property
    def optimizer(self) -> nnx.Optimizer:
        return nnx.merge(self.graphdef, self.state)[1]


def split_state(model: MLP, optimizer: nnx.Optimizer) -> SplitState:
    graphdef, state = nnx.split((model, optimizer))
    return SplitState(graphdef, nnx.to_pure_dict(state))


@functools.partial(jax.jit, donate_argnums=0)
def train_calls_fast(ts: SplitState, key: jax.Array, batch_KxG):
    """K steps in one compiled call over the split state; returns it and each step's loss."""

    def step(carry, batch):
        state, key = carry
        model, optimizer = nnx.merge(ts.graphdef, state)
        key, step_key = jax.random.split(key)
        nnx.reseed(model, dropout=step_key)

        def loss_fn(m):
            losses_G = per_example_loss(m, batch)
            return jnp.mean(losses_G), losses_G

        (_, losses_G), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return (nnx.to_pure_dict(nnx.state((model, optimizer))), key), losses_G

    (state, _), losses_KxG = jax.lax.scan(step, (ts.state, key), batch_KxG)
    return ts.replace(state=state), jnp.mean(losses_KxG, axis=1)  # the loss averaged once, after the scan
