"""What one device holds while a call runs: the checked run's and each twin's, so that the report shows
whether a twin fits where the run fits.

The suite's own fused calls (a model port's split form, and its twins) are read from XLA's compiled memory
analysis (``compiled``): ``lower(...).compile()`` of a jitted call that has already run is JAX's cached
executable (no compile), so this costs nothing but the call's inputs placed once more. A loop port's call
is the team's code, one or several programs the suite does not compile itself: what its device holds of
the call's arguments is read instead (``placed``: the train state as the team's own step last placed it,
the keys and the batch as the suite places them), measured after the run for the run and for each twin
alike. The larger of the devices' is said.
"""

from typing import Any

import jax

FIELDS = ('argument', 'output', 'alias', 'temp')


def per_device(setup: Any, batch_KxG: Any, rng: jax.Array) -> dict[str, int] | None:
    """``{'argument', 'output', 'alias', 'temp', 'held'}`` bytes per device of one call of ``setup``
    (``held``: arguments, outputs not aliased to them, and temporaries; a loop port's: ``{'argument',
    'held'}``, its arguments alone, ``placed``); None where not measurable."""
    found = compiled(setup, batch_KxG, rng)
    return found if found is not None else placed(setup, batch_KxG, rng)


def compiled(setup: Any, batch_KxG: Any, rng: jax.Array) -> dict[str, int] | None:
    """XLA's memory analysis of the suite's own fused call of ``setup``; None for a call that is not one."""
    fused = getattr(setup, 'fused', None)
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


def placed(setup: Any, batch_KxG: Any, rng: jax.Array) -> dict[str, int] | None:
    """``{'argument', 'held'}``: the bytes of a loop port's call arguments on its fullest device (its
    train state where the team's step left it, its keys and batch as placed); None without a train state."""
    state = getattr(setup, 'train_state', None)
    if state is None:
        return None
    _, args = setup.call_args(rng, batch_KxG)
    on: dict = {}
    seen = set()
    for leaf in jax.tree.leaves((state, args)):
        if not isinstance(leaf, jax.Array) or id(leaf) in seen or leaf.is_deleted():
            continue
        seen.add(id(leaf))
        for shard in leaf.addressable_shards:
            on[shard.device] = on.get(shard.device, 0) + shard.data.nbytes
    if not on:
        return None
    most = max(on.values())
    return {'argument': most, 'held': most}


def line(run: dict | None, twins: dict[str, dict | None]) -> str:
    """One line for the report: the twins' bytes per device next to the run's, and their ratio."""
    if run is None or not twins or any(t is None for t in twins.values()):
        return ''
    each = '; '.join(f'twin {name}: {_kb(t)} ({t["held"] / run["held"]:.2f}x)' for name, t in twins.items())
    how = 'XLA memory analysis of one call' if 'temp' in run else "one call's arguments, as placed"
    return f'bytes per device ({how}): run {_kb(run)}; {each}'


def _kb(m: dict) -> str:
    if 'temp' not in m:  # a loop port's: its arguments alone
        return f'{m["held"] / 1e3:.1f} kB of arguments'
    return f'{m["held"] / 1e3:.1f} kB (arguments {m["argument"] / 1e3:.1f} kB)'
