"""The same team's NNX port, written as the Flax docs teach (not part of the suite).

Attributes named for what they are (``fc1``, ``norm``, ``fc2``), dropout owning its
random stream through ``nnx.Rngs``, and K steps fused by ``nnx.jit(nnx.scan)`` over the
model and optimizer objects. No ``pmean``: the loss is the mean over the global batch, and
the partitioner combines the gradients.
"""

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
