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

from equivalence.core.port.paths import key_name
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


def arrays(setup: Any, batch_KxG: Any, rng: jax.Array) -> dict[str, int | str | None]:
    """The bytes the most loaded device holds of a loop port's train state (as its step left it) and of
    one call's inputs (as placed): ``argument`` and ``held`` alike, the rest unknown (None)."""
    _, args = setup.call_args(rng, batch_KxG)
    held: dict = {}
    for leaf in jax.tree.leaves((setup.train_state, args)):
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
    """Each parameter's partition spec as its arrays are placed (a sharding other than a named one is
    said by its split dimensions, ``P('split', None)``)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        placed = getattr(leaf, 'sharding', None)
        if placed is None:
            continue
        shape = tuple(leaf.shape)
        if isinstance(placed, jax.sharding.NamedSharding):
            spec = placed.spec
        else:
            each = placed.shard_shape(shape)
            spec = jax.sharding.PartitionSpec(*('split' if e < n else None for e, n in zip(each, shape, strict=True)))
        out.append(sharding.Decision('/'.join(key_name(k) for k in path), shape, spec))
    return out
