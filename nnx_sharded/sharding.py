"""Every placement decision of the sharded path: mesh, PartitionSpecs, data and state.

The train step knows nothing of devices. A parallelism strategy is a placement: this
module says where each array lives, and XLA's partitioner derives the communication
(the gradient all-reduce of data parallelism) from it.
"""

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = 'data'  # the mesh axis the global batch is split over


def make_mesh(n_devices: int) -> Mesh:
    """A 1-D mesh over the first ``n_devices`` devices.

    ``AxisType.Auto``: shardings flow from the placed inputs through ``jit`` and the
    partitioner fills in the rest. ``jax.make_mesh``'s default, ``Explicit``, makes every
    intermediate's sharding part of its type and requires ``jax.set_mesh``; that buys
    nothing for plain data parallelism.
    """
    devices = jax.devices()[:n_devices]
    return jax.make_mesh((n_devices,), (DATA,), axis_types=(AxisType.Auto,), devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """Data parallelism: every leaf of the model and optimizer state on every device."""
    return jax.tree.map(lambda _: replicated(mesh), state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``[K, G, ...]``: steps stay whole, the global batch G is split over the data axis."""
    return NamedSharding(mesh, P(None, DATA))


def key_sharding(mesh: Mesh, rng_mode: str) -> NamedSharding:
    """per-device keys ``[D, 2]``: row d lives on device d; one global key: everywhere."""
    return NamedSharding(mesh, P(DATA)) if rng_mode == 'per-device' else replicated(mesh)


def put(x: jax.Array | np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``jax.device_put`` that also places onto devices of other processes: every process holds
    the same value (one seed), hands over all of it, and JAX keeps its devices' parts.
    (``device_put`` refuses a committed array or a typed key for devices it cannot address.)"""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed keys travel as their key data
        return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    return jax.make_array_from_process_local_data(sharding, np.asarray(x), np.shape(x))


def place_state(state: Any, mesh: Mesh) -> Any:
    return jax.tree.map(put, state, state_shardings(state, mesh))


def place_objects(train_state: Any, mesh: Mesh) -> Any:
    """NNX objects (a model, an ``nnx.Optimizer``, a tuple of them), replicated in place; or plain arrays."""
    place = lambda tree: jax.tree.map(lambda x: put(x, replicated(mesh)), tree)
    if not any(isinstance(x, nnx.Object) for x in jax.tree.leaves(train_state, is_leaf=_is_object)):
        return place(train_state)
    nnx.update(train_state, place(nnx.state(train_state)))
    return train_state


def _is_object(x) -> bool:
    return isinstance(x, nnx.Object)


def place_batch(batch_KxG: Any, mesh: Mesh) -> Any:
    """This process's rows of the global batch (all of them, with one process) -> the global
    ``[K, G, ...]`` array: each process hands over only the rows its devices hold."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharding(mesh), x), batch_KxG)


def place_keys(keys: jax.Array, mesh: Mesh, rng_mode: str) -> jax.Array:
    """Every process holds the same keys (one host key chain); each device takes its row."""
    return put(keys, key_sharding(mesh, rng_mode))
