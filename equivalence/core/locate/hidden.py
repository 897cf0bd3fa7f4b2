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

A part seen in the forward pass alone is confirmed on the whole first step's recording (``Recorder.runs``,
which the location reads next on a MISMATCH) before it becomes a leaf: the forward pass compiled without
the backward pass is another program, fused otherwise, and rounds otherwise. score_sde_port at D = 8
(correct; K = 2, C = 2): its forward pass alone parted at ``attn/out`` by 2.15e-06 (9 float32 spacings,
the twin bitwise the new side there, 8 allowed), a MISMATCH with exit 1 on a correct port, while the
whole step's recording held all 22 module calls within their floors. Only the whole step's recording
decides.
"""

import dataclasses

from equivalence.core.compare.compare import LeafDiff
from equivalence.core.compare.findings import Held
from equivalence.core.compare.location import Where
from equivalence.core.locate import locate
from equivalence.core.locate.first_step import Recorder

FORWARD = frozenset({'forward'})  # only a module call is a place this check adds: the locator's strongest evidence


def needed(report, seen: locate.Seen) -> bool:
    """Whether a MATCH leaves parameters unverified by value (noise-dominated), which the first step may verify."""
    return report.match and bool(seen.noisy)


def first_step_leaves(recorder: Recorder, seen: locate.Seen) -> tuple[list[LeafDiff], Held]:
    """``(leaves, what was done)``: the module call of the first step that parts beyond its floor, as one
    failing leaf (none where nothing parts), and what was done (``findings.Held``). Held first on the
    forward pass alone (``Recorder.forward``, a fraction of the compile); a part there is held again on the
    whole step's recording (``Recorder.runs``), which alone decides."""
    leaves, said = _held(recorder, recorder.forward, seen)
    if not leaves or recorder.recorded_whole:  # forward was the whole step's recording: judged already
        return leaves, said
    alone = leaves[0]
    try:
        whole = recorder.runs
    except Exception:  # noqa: BLE001 -- no whole step's recording (its location will say why): the part stands
        return leaves, dataclasses.replace(said, whole_failed=True)
    leaves, said = _held(recorder, whole, seen)
    if leaves:
        return leaves, said
    return [], dataclasses.replace(said, alone=alone)


def _held(recorder: Recorder, runs: tuple, seen: locate.Seen) -> tuple[list[LeafDiff], Held]:
    """``first_step_leaves`` on one recording of the first step (``runs``)."""
    kind, inputs = recorder.kind, recorder.inputs
    if locate.not_reproduced(runs[0], seen):
        return [], Held(reproduced=False)
    found = locate.judge_step(kind, *runs, inputs.mapping, inputs.variables, noisy=seen.noisy, allowed=FORWARD)
    calls = len(found.modules)
    if found.kind not in (Where.MODULE, Where.BETWEEN, Where.RANDOMNESS) or found.first is None:
        return [], Held(calls=calls)
    m = found.modules[found.first]
    what = 'input' if not m.input_ok else 'output'  # a between (inside) a module is its output's
    diff, allowed = (m.input_diff, m.input_allowed) if what == 'input' else (m.output_diff, m.output_allowed)
    if allowed is None or not diff > allowed:  # no number parts: no leaf fails
        return [], Held(calls=calls)
    leaf = LeafDiff('first_step', f'forward/{m.new}/{what}', diff, diff, False, size=1, bad=1,
                    floor=m.output_floor, limit=allowed)  # fmt: skip
    return [leaf], Held(calls=calls, part=(str(found.kind), m.new))
