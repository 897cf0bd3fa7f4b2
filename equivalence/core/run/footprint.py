"""What one device holds while a call runs, from XLA's compiled memory analysis: the checked run's
and each twin's, so that the report shows whether a twin fits where the run fits.

``lower(...).compile()`` of a jitted call that has already run is JAX's cached executable (no
compile), so this costs nothing but the call's inputs placed once more. Only the suite's own fused
calls (a model port's split form, and the twins') are read: a loop port's call is the user's code,
one or several programs the suite does not compile itself.
"""

from typing import Any

import jax

FIELDS = ('argument', 'output', 'alias', 'temp')


def per_device(setup: Any, batch_KxG: Any, rng: jax.Array) -> dict[str, int] | None:
    """``{'argument', 'output', 'alias', 'temp', 'held'}`` bytes per device of one call of ``setup``
    (``held``: arguments, outputs not aliased to them, and temporaries); None where not measurable."""
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


def line(run: dict | None, twins: dict[str, dict | None]) -> str:
    """One line for the report: the twins' bytes per device next to the run's, and their ratio."""
    if run is None or not twins or any(t is None for t in twins.values()):
        return ''
    each = '; '.join(f'twin {name}: {_kb(t)} ({t["held"] / run["held"]:.2f}x)' for name, t in twins.items())
    return f'bytes per device (XLA memory analysis of one call): run {_kb(run)}; {each}'


def _kb(m: dict) -> str:
    return f'{m["held"] / 1e3:.1f} kB (arguments {m["argument"] / 1e3:.1f} kB)'
