"""Which rows of the global batch this process reads and feeds, and which per-device keys it hands pmap.

A run on D devices lays the global batch out by device position on the legacy side: position
``d`` of ``jax.devices()[:D]`` gets rows ``d*B:(d+1)*B`` of every step (B = G/D). The NNX side
feeds the rows its batch sharding gives this process's devices: a slice of the ``data`` axis,
and all the rows a ``model`` axis copies (a batch replicated over ``model`` is fed identically
to every process that shares it, and whole where ``model`` spans every process). A process
reads the rows either path needs (``hull``) and hands each path its own (``take``): with
several processes no process reads more of the data than its devices hold. With one process
every slice is all of it.
"""

from typing import Any

import jax
from jax.sharding import Sharding

Rows = slice  # rows start:stop of the global batch (axis 1 of [K, G, ...]); step 1


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


def pmap_rows(n_devices: int, rows_total: int) -> Rows:
    """The rows pmap's per-device layout gives this process's devices."""
    mine, per_device = positions(n_devices), rows_total // n_devices
    return slice(mine.start * per_device, mine.stop * per_device)


def held_rows(sharding: Sharding, rows_total: int) -> Rows:
    """The rows of a ``[K, G, ...]`` array placed with ``sharding`` that this process's devices
    hold: what ``jax.make_array_from_process_local_data`` expects from it. One contiguous run
    (a mesh's axes are laid over devices in order), or ``RuntimeError``."""
    indices = sharding.addressable_devices_indices_map((1, rows_total)).values()
    covered = sorted({_bounds(index[1], rows_total) for index in indices})
    if any(stop < next_start for (_, stop), (next_start, _) in zip(covered, covered[1:], strict=False)):
        where = f'process {jax.process_index()} holds rows {covered} of {rows_total}'
        raise RuntimeError(f'{where}: not one contiguous run')
    return slice(covered[0][0], max(stop for _, stop in covered))


def _bounds(index: slice, total: int) -> tuple[int, int]:
    return (index.start or 0, total if index.stop is None else index.stop)


def hull(*spans: Rows) -> Rows:
    """The smallest run of rows covering every span: what this process reads."""
    return slice(min(s.start for s in spans), max(s.stop for s in spans))


def take(batch_KxR: Any, want: Rows, have: Rows) -> Any:
    """``[K, R, ...]`` holding rows ``have`` -> the rows ``want`` (within ``have``); the same batch when equal."""
    if (want.start, want.stop) == (have.start, have.stop):
        return batch_KxR
    if want.start < have.start or want.stop > have.stop:
        raise RuntimeError(f'rows {want.start}:{want.stop} wanted from a batch of rows {have.start}:{have.stop}')
    part = slice(want.start - have.start, want.stop - have.start)
    return jax.tree.map(lambda v: v[:, part], batch_KxR)


def local_batch(batch_KxG: Any, n_devices: int, rows: Rows | None = None) -> Any:
    """``[K, G, ...] -> [K, R, ...]``: ``rows`` of every step (default: this process's pmap rows)."""
    total = jax.tree.leaves(batch_KxG)[0].shape[1]
    return take(batch_KxG, rows or pmap_rows(n_devices, total), slice(0, total))


def local_keys(keys_D: jax.Array, n_devices: int) -> jax.Array:
    """``[D, ...] -> [n, ...]``: the per-device keys of this process's devices, for pmap."""
    mine = positions(n_devices)
    return keys_D[mine.start : mine.stop]
