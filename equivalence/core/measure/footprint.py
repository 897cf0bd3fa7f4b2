"""What one device holds while a call runs, from XLA's compiled memory analysis: the checked run's
and each twin's, so that the report shows whether a twin fits where the run fits.

``lower(...).compile()`` of a jitted call that has already run is JAX's cached executable (no
compile), so this costs nothing but the call's inputs placed once more. That is read for the suite's
own fused calls (a model port's split form, and its twins). A loop port's call is the team's code, one
or several programs the suite does not compile itself: there the arrays are read instead (``arrays``),
the train state as the team's step left it and one call's inputs as placed, the bytes each device
holds of them (``source: 'arrays'``; the program's temporaries are not known).
"""

from typing import Any

import jax

from equivalence.core.state.paths import key_name
from nnx_sharded import sharding

FIELDS = ('argument', 'output', 'alias', 'temp')
ARRAYS = 'arrays'  # ``source`` of a footprint read from the arrays, not from XLA's analysis


def per_device(setup: Any, batch_KxG: Any, rng: jax.Array) -> dict[str, int] | None:
    """``{'argument', 'output', 'alias', 'temp', 'held'}`` bytes per device of one call of ``setup``
    (``held``: arguments, outputs not aliased to them, and temporaries); None where not measurable."""
    fused = getattr(setup, 'fused', None)
    if hasattr(setup, 'train_state') and not hasattr(fused, 'lower'):
        return arrays(setup, batch_KxG, rng)
    if not hasattr(fused, 'lower') or not hasattr(setup, 'state'):
        return None
    _, args = setup.call_args(rng, batch_KxG)
    stats = fused.lower(*args).compile().memory_analysis()
    stats = stats[0] if isinstance(stats, list | tuple) else stats
    if stats is None:  # a backend that reports nothing
        return None
    out = {f: int(getattr(stats, f'{f}_size_in_bytes')) for f in FIELDS}
    out['held'] = out['argument'] + out['output'] - out['alias'] + out['temp']
    return out


def arrays(setup: Any, batch_KxG: Any, rng: jax.Array) -> dict[str, int | str | None] | None:
    """The bytes the most loaded device of this process holds of a loop port's train state (as its step
    left it) and of one call's inputs (as placed): ``argument`` and ``held`` alike, the rest unknown
    (None). None where they cannot be read (an array deleted, a leaf without shards): a figure, never an
    error in the report."""
    try:
        _, args = setup.call_args(rng, batch_KxG)
        return _held_by_arrays((setup.train_state, args))
    except Exception:  # noqa: BLE001 -- the bytes are said where readable; nothing else depends on them
        return None


def _held_by_arrays(tree: Any) -> dict[str, int | str | None]:
    held: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, 'addressable_shards', ()):
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    most = max(held.values(), default=0)
    return {'argument': most, 'output': None, 'alias': None, 'temp': None, 'held': most, 'source': ARRAYS}


def line(run: dict | None, twins: dict[str, dict | None]) -> str:
    """One line for the report: the twins' bytes per device next to the run's, and their ratio."""
    if run is None or not twins or any(t is None for t in twins.values()) or not run['held']:
        return ''
    each = '; '.join(f'twin {name}: {_kb(t)} ({t["held"] / run["held"]:.2f}x)' for name, t in twins.items())
    if run.get('source') == ARRAYS:
        what = "the train state as the port's step placed it and one call's inputs, the arrays read"
        return f'bytes per device ({what}): run {run["held"] / 1e3:.1f} kB; {each}'
    return f'bytes per device (XLA memory analysis of one call): run {_kb(run)}; {each}'


def _kb(m: dict) -> str:
    if m.get('source') == ARRAYS:
        return f'{m["held"] / 1e3:.1f} kB'
    return f'{m["held"] / 1e3:.1f} kB (arguments {m["argument"] / 1e3:.1f} kB)'


def placement(params: Any) -> list[sharding.Decision]:
    """Each parameter's partition spec as its arrays are placed, naming only the dimensions actually split
    (one over a mesh axis of size 1 is whole); a sharding other than a named one says ``P('split', None)``."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        placed = getattr(leaf, 'sharding', None)
        if placed is None:
            continue
        shape, named = tuple(leaf.shape), isinstance(placed, jax.sharding.NamedSharding)
        axes = tuple(placed.spec) + (None,) * (len(shape) - len(placed.spec)) if named else (None,) * len(shape)
        each = placed.shard_shape(shape)  # a dim over an axis of size 1 is whole: not split
        spec = [(a if named else 'split') if e < n else None for a, e, n in zip(axes, each, shape, strict=True)]
        while spec and spec[-1] is None:  # P('data') for P('data', None), P() where whole, as JAX writes them
            spec.pop()
        out.append(sharding.Decision('/'.join(key_name(k) for k in path), shape, jax.sharding.PartitionSpec(*spec)))
    return out
