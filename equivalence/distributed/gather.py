"""Reading state back for comparison when no process may hold all of it: a conversion step.

``equivalence.core.state.convert`` turns each framework's state into named host arrays; this
comes first, turning arrays that span several processes into host arrays holding their
whole logical value, so that the comparison never learns about processes. An array this
process can read whole (every shard local, or a full copy local, as replicated state
is) is read directly; one split across processes is all-gathered, in every process
(``multihost_utils.process_allgather``: a collective, so every process calls this at
the same points of the run, which the harness does).
"""

from collections.abc import Callable
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


class ProcessError(RuntimeError):
    """Another process raised where this one did not (``together``): its first line, and which process."""


def together(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` in every process, raising in every process when it raised in any: for what each
    process computes alone (the verdict's twin) before a collective that a process which raised would
    never reach, where the others would wait on it. This process's own exception is raised as it is;
    the others raise ``ProcessError`` naming the first process that raised and its line. A
    collective: every process calls it at the same point. One process: ``fn(*args)``."""
    if jax.process_count() == 1:
        return fn(*args)
    try:
        out, error = fn(*args), None
    except Exception as e:  # noqa: BLE001 -- raised again below, once every process knows
        out, error = None, e
    lines = _every_line('' if error is None else f'{type(error).__name__}: {(str(error).splitlines() or [""])[0]}')
    if error is not None:
        raise error
    raised = [(i, line) for i, line in enumerate(lines) if line]
    if raised:
        i, line = raised[0]
        raise ProcessError(f'process {i} of {len(lines)} raised {line}')
    return out


def _every_line(line: str, width: int = 240) -> list[str]:
    """Every process's ``line`` (its first ``width`` bytes), in process order: one all-gather."""
    mine = np.frombuffer(line.encode()[:width].ljust(width, b'\0'), dtype=np.uint8).astype(np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), width)
    return [bytes(row.astype(np.uint8)).rstrip(b'\0').decode(errors='replace') for row in every]


def _floating(x: Any) -> bool:
    return isinstance(x, np.ndarray | jax.Array) and jax.dtypes.issubdtype(x.dtype, np.floating)
