"""A MATCH whose noise-dominated parameters cannot verify them, held once more on the first step, module by
module (``first_step_leaves``): a slip there may pass every leaf at the end, as score_sde's DDPM hides a
changed time embedding behind its zero-initialised output convolution (74 of 300 leaves noise-dominated,
the parameters 1.2e-3 apart, every leaf within its floor: a MATCH, exit 0, on a real forward change).

The first step's module calls, recorded on each side and on the twin (its forward pass alone, compiled
without the backward pass and the update: ``Recorder.forward``), are held to their own floors by the
locator (``locate.judge_step``), with its guards: a noise-dominated parameter is never the place, a
recording that does not reproduce its run names nothing. Where it names a module call (its output, its
input, or its random draws), that call is a leaf of the verdict's report (``first_step/forward/<path>``),
outside its floor: the verdict is a MISMATCH. Where nothing parts, or the place is no module call, nothing
is added and the MATCH stands.
"""

from equivalence.core.verdict import locate
from equivalence.core.verdict.compare import LeafDiff
from equivalence.core.verdict.first_step import Recorder
from equivalence.core.verdict.location import Where

FORWARD = frozenset({'forward'})  # only a module call is a place this check adds: the locator's strongest evidence


def needed(report, seen: locate.Seen) -> bool:
    """Whether a MATCH leaves parameters unverified by value (noise-dominated), which the first step may verify."""
    return report.match and bool(seen.noisy)


def first_step_leaves(recorder: Recorder, seen: locate.Seen) -> tuple[list[LeafDiff], str]:
    """``(leaves, what was done)``: the module call of the first step that parts beyond its floor, as one
    failing leaf (none where nothing parts), and the words for the verdict's ``done``."""
    kind, inputs, runs = recorder.kind, recorder.inputs, recorder.forward
    if locate.not_reproduced(runs[0], seen):
        return [], 'first step not held module by module: its recording does not reproduce the run'
    found = locate.judge_step(kind, *runs, inputs.mapping, inputs.variables, noisy=seen.noisy, allowed=FORWARD)
    calls = len(found.modules)
    if found.kind not in (Where.MODULE, Where.BETWEEN, Where.RANDOMNESS) or found.first is None:
        return [], f'first step held module by module: {calls} module calls within their floors'
    m = found.modules[found.first]
    what = 'input' if not m.input_ok else 'output'  # a between (inside) a module is its output's
    diff, allowed = (m.input_diff, m.input_allowed) if what == 'input' else (m.output_diff, m.output_allowed)
    if allowed is None or not diff > allowed:  # no number parts: no leaf fails
        return [], f'first step held module by module: {calls} module calls within their floors'
    leaf = LeafDiff('first_step', f'forward/{m.new}/{what}', diff, diff, False, size=1, bad=1,
                    floor=m.output_floor, limit=allowed)  # fmt: skip
    return [
        leaf
    ], f'first step held module by module (noise-dominated leaves cannot verify): {found.kind} at {m.new} parts'
