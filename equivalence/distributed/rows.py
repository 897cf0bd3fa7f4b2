"""Which rows of the global batch this process feeds, and which per-device keys it hands pmap.

A run on D devices lays the global batch out by device position: position ``d`` of
``jax.devices()[:D]`` gets rows ``d*B:(d+1)*B`` of every step (B = G/D), on both paths.
With several processes each drives a contiguous run of positions (JAX numbers a process's
devices together), so each reads only its own ``[K, G*n/D, ...]`` slice of the data: the
global batch is never handed to JAX in any process. With one process the slice is all of it.
"""

from typing import Any

import jax


def positions(n_devices: int) -> range:
    """The positions in ``jax.devices()[:n_devices]`` that belong to this process."""
    mine = [i for i, d in enumerate(jax.devices()[:n_devices]) if d.process_index == jax.process_index()]
    if not mine or mine != list(range(mine[0], mine[-1] + 1)):
        where = f'process {jax.process_index()} drives positions {mine} of {n_devices}'
        raise RuntimeError(f'{where}: not one contiguous run of devices')
    return range(mine[0], mine[-1] + 1)


def local_devices(n_devices: int) -> list:
    """This process's devices among the first ``n_devices``: where pmap's per-process inputs live."""
    return [jax.devices()[i] for i in positions(n_devices)]


def local_batch(batch_KxG: Any, n_devices: int) -> Any:
    """``[K, G, ...] -> [K, G*n/D, ...]``: the rows of this process's n devices, from every step."""
    mine = positions(n_devices)
    per_device = jax.tree.leaves(batch_KxG)[0].shape[1] // n_devices
    rows = slice(mine.start * per_device, mine.stop * per_device)
    return jax.tree.map(lambda v: v[:, rows], batch_KxG)


def local_keys(keys_D: jax.Array, n_devices: int) -> jax.Array:
    """``[D, ...] -> [n, ...]``: the per-device keys of this process's devices, for pmap."""
    mine = positions(n_devices)
    return keys_D[mine.start : mine.stop]
