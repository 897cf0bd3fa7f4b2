"""The same workload migrated from ``jax.pmap`` to linen + ``jax.jit`` (no NNX), as benchmark
workloads were: the state is a dict ``{'params', 'opt_state'}``, the mesh is built once, at import,
from ``jax.devices()``, and the step is ``jax.jit`` with ``in_shardings`` (the state replicated,
the batch split over the mesh) and ``out_shardings``. No ``pmean``: the loss is the mean over the
global batch, and the partitioner places the gradient's all-reduce. Not part of the suite.
"""

import functools

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from legacy_code import loss_fn, make_tx

MESH = Mesh(np.array(jax.devices()), ('batch',))
REPLICATED = NamedSharding(MESH, P())
BATCH_SHARDED = NamedSharding(MESH, P('batch'))


def create_train_state(params, tx: optax.GradientTransformation) -> dict:
    return {'params': params, 'opt_state': tx.init(params)}


def train_step(state, batch, tx):
    loss, grads = jax.value_and_grad(loss_fn)(state['params'], batch)
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    return {'params': optax.apply_updates(state['params'], updates), 'opt_state': opt_state}, {'loss': loss}


def make_train_step(tx: optax.GradientTransformation):
    return jax.jit(functools.partial(train_step, tx=tx), in_shardings=(REPLICATED, BATCH_SHARDED),
                   out_shardings=(REPLICATED, REPLICATED))  # fmt: skip


tx = make_tx()
jit_train_step = make_train_step(tx)
