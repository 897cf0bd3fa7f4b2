"""Where the sides part when the pmap side was recorded on another JAX (``across_versions``).

XLA's elementwise functions round otherwise from one version to the next: the sine and cosine of
score_sde's time embedding, arguments up to 999, are up to 125 float32 spacings apart between jax 0.4.38
and 0.10.2 (docs/record.md). No floor measured on one version covers that, so against such a reference a
place in what the step computes (a module, the code between modules, the loss, the backward pass, the
statistics) is no evidence, nor is a first step left unlocated for a reason rounding alone can give
(``ROUNDED``: score_sde's sine parts example by example). The update, the EMA and the pmap step's
collectives are arithmetic that both versions round alike, and stay named as found.

A computed place is placed again where the pmap code still runs: its first steps are recorded here, on
today's JAX, from the reference's own inputs (its variables, batches and keys, drawn as recorded), and
the port is located against them, as a check of both sides locates it. Where nothing parts there, the
port and the pmap code agree on today's JAX, and what parts against the reference is what the upgrade
changed. Where the pmap code is gone (``RECORDED``) or no longer runs, the place stays unlocated.
"""

import dataclasses
from collections.abc import Callable

import jax

from equivalence.core.compare.location import Location, Unplaced, Where
from equivalence.core.measure import clock
from equivalence.core.run.inputs import Inputs

COMPUTED = (Where.MODULE, Where.BETWEEN, Where.LOSS, Where.BACKWARD, Where.STATISTICS)  # no evidence across versions
# The reasons for no place that rounding alone can give (the rest: the recording could not run, or not pair, or
# the data are not finite, which another JAX does not change)
ROUNDED = (Unplaced.BY_EXAMPLE, Unplaced.STARTS_APART, Unplaced.BEFORE_EMA, Unplaced.LOSS_OR_DECAY, Unplaced.ONE_FACTOR,
           Unplaced.GRADIENT_OR_SETTING)  # fmt: skip


def across_versions(found: Location, inputs: Inputs, seen, versions: str,
                    again: Callable[[Inputs, object], Location]) -> Location:  # fmt: skip
    """``found`` (against a reference recorded on ``versions``, another JAX) where it is not a computed place;
    else the place ``again`` (the locator, given inputs and what the verdict saw) finds against the pmap code
    run here, from the reference's inputs; else unlocated, saying why."""
    if found.kind not in COMPUTED and found.why not in ROUNDED:
        return found
    if found.kind == Where.UNLOCATED:  # its own reasons may be the rounding too: sin parting example by example
        parted = f'the first step was not located ({found.figures.removeprefix("not located: ")})'
    else:
        parted = f'the first step parts at {found.kind} {found.new} ({found.figures})'
    why = (f'the reference was recorded on {versions}, whose XLA rounds elementwise functions otherwise: a place in '
           'the forward or backward pass is no evidence across versions')  # fmt: skip
    gone = inputs.recorded.gone
    if gone:
        here_not = f'the pmap code, which would place it on this JAX, is not here ({", ".join(gone)} RECORDED)'
        return found.unplaced(f'not located: {parted}, but {why}; {here_not}', Unplaced.ACROSS_VERSIONS)
    today = dataclasses.replace(inputs, recorded=None)
    new_only = dataclasses.replace(seen, first_losses={k: v for k, v in seen.first_losses.items() if k == 'new'})
    try:
        with clock.stage('where the sides part, against the pmap code run on this JAX (the first steps recorded)'):
            placed = again(today, new_only)
    except Exception as e:  # noqa: BLE001 -- the code the reference was recorded from need not run on today's JAX
        return found.unplaced(f'not located: {parted}, but {why}; the pmap code, run on this JAX to place it, '
                              f'raised {type(e).__name__}: {str(e)[:160]}', Unplaced.ACROSS_VERSIONS)  # fmt: skip
    here = jax.__version__
    if placed.kind.stage is None:  # nothing parts, or no place, against the pmap code run here
        return found.unplaced(f'not located: {parted}, but {why}; against the pmap code run on this JAX (jax '
                              f'{here}) from the same inputs: {placed.figures}',
                              Unplaced.UPGRADE if placed.kind == Where.NONE else placed.why)  # fmt: skip
    note = (f"placed against the pmap code run on this JAX (jax {here}), from the reference's inputs, as a check of "
            f'both sides places it: against the reference itself, recorded on {versions}, whose XLA rounds '
            f'elementwise functions otherwise, {parted}')  # fmt: skip
    return dataclasses.replace(placed, notes=(*placed.notes, note))
