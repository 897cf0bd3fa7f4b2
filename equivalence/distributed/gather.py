"""Reading state back for comparison when no process may hold all of it: a conversion step.

``equivalence.core.port.convert`` turns each framework's state into named host arrays; this
comes first, turning arrays that span several processes into host arrays holding their
whole logical value, so that the comparison never learns about processes. An array this
process can read whole (every shard local, or a full copy local, as replicated state
is) is read directly; one split across processes is all-gathered, in every process
(``multihost_utils.process_allgather``: a collective, so every process calls this at
the same points of the run, which the harness does).
"""

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def to_host(tree: Any) -> Any:
    """Every ``jax.Array`` leaf as a numpy array of its global value; other leaves unchanged."""
    return jax.tree.map(_host, tree)


def _host(x: Any) -> Any:
    if not isinstance(x, jax.Array):
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # an NNX Rngs key: its data, wrapped again
        return jax.random.wrap_key_data(_host(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def from_process_0(tree: Any) -> Any:
    """Process 0's value of every floating leaf, in every process (other leaves as they are).

    For what each process computes alone, on its own devices (the verdict's twin): the same
    program gives the same numbers on like hosts, but hosts of different CPUs may round apart,
    and every process must reach the same verdict. A collective: every process calls it at the
    same point. One process: the tree unchanged."""
    if jax.process_count() == 1:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    floats = [i for i, x in enumerate(leaves) if _floating(x)]
    shared = multihost_utils.broadcast_one_to_all([np.asarray(leaves[i]) for i in floats])
    for i, x in zip(floats, shared, strict=True):
        leaves[i] = np.asarray(x)
    return jax.tree.unflatten(treedef, leaves)


def _floating(x: Any) -> bool:
    return isinstance(x, np.ndarray | jax.Array) and jax.dtypes.issubdtype(x.dtype, np.floating)
