"""A twin on the checked run's own devices whose global batch holds its rows in another order
(``Reordered``): every device sums other examples, in another order, and holds what a device of the
run holds, so that a model whose batch or state fits only spread over the devices has room for it.

The twin of every placement on D > 1 in one process: a sharded strategy's (fsdp, tp, fsdp-tp), data
parallelism's and ``shard_map``'s (``verdict.twin.twin_kinds``), and a loop port's own step where its
first call draws no random numbers (an example's numbers are drawn by its position, which the twin
changes; the model port's loss is handed each example's own noise, ``model_side.reordered_loss``).
"""

import dataclasses

import jax
import numpy as np

INTERLEAVED, SHUFFLED = 'interleaved', 'shuffled'
SEED = 20261204  # the shuffled twin's fixed permutation: the same for every step and every check


@dataclasses.dataclass(frozen=True)
class Reordered:
    """A twin on the checked run's own D devices, placed by ``strategy``, its global batch's rows in
    ``order``: ``interleaved`` (the examples of each device of the run spread over every device) or
    ``shuffled`` (one fixed permutation of the G examples, the same for every step)."""

    strategy: str  # the run's own (its mesh too), or another placement of the same devices
    order: str = INTERLEAVED

    def rows(self, g: int, data: int) -> np.ndarray:
        """Position i of the twin's batch holds example ``rows[i]``. Interleaved: with k groups (the mesh's
        data axis, else 2), the examples of group c are spread over positions c, c + k, c + 2k, ...;
        shuffled: a permutation that moves examples across the k groups, never the identity."""
        k = next((k for k in (data, 2) if k > 1 and g % k == 0), 1)
        if self.order == SHUFFLED:
            return shuffled(g, k)
        return np.arange(g).reshape(k, g // k).T.ravel()

    def __str__(self) -> str:
        return f'{self.strategy}, batch rows {self.order}'


def shuffled(g: int, k: int) -> np.ndarray:
    """A fixed permutation of ``g`` examples (``SEED``) under which some example changes its group of
    ``g // k`` positions (when ``k > 1``), so that a device sums others."""
    for attempt in range(100):
        perm = np.random.default_rng(SEED + attempt).permutation(g)
        if k <= 1 or g < 2 or (perm // (g // k) != np.arange(g) // (g // k)).any():
            return perm
    return np.roll(np.arange(g), g // k)  # pragma: no cover -- a permutation always moves one in 100 tries


TwinKind = int | Reordered  # a twin: data parallel on that many devices, or the run's devices placed and reordered


def take(batch_KxG, rows: np.ndarray):
    """The global batch ``[K, G, ...]`` with its rows in ``rows`` order (position i holds example ``rows[i]``)."""
    return jax.tree.map(lambda v: np.asarray(v)[:, rows], batch_KxG)
