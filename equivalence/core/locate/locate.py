"""Where the two sides part: the first module, loss, gradient, statistic or optimizer slot whose
first-step value leaves its own measured floor (issue 27).

The first step is run once more on each side and on the NNX twin, every module call recorded
(``intercept``). Modules are paired through the port's ``names`` (``pairing``): a linen module with
the NNX module that holds what it holds; one without variables by the same renaming of its path; a
Dropout by its place among the Dropout calls, which is how the randomness bridge keys its masks.
Every value is held to the verdict's rule (``compare.compare_to_floor``, ``MEASURED_FLOOR``:
``max(10 x |nnx - twin|, 8 float32 spacings)``), and the first place that parts, in this order, is
named (``Location``):

1. forward, in the order the pmap side's module calls finished: the first call whose input or
   output parts. An input that parts while everything before agrees is the code that feeds it
   (``between``: an activation, a residual, a mask between two modules); an output that parts
   while its inputs agree is that module (``module``), or the code between its submodules when it
   holds some and they all agree (``between``), or, for a Dropout, its draw (``randomness``);
2. the loss (``loss``): every module agrees and the loss does not;
3. the backward pass (``backward``, model ports): the first parameter, from the output back, whose
   gradient parts;
4. running statistics (``statistics``): the module whose statistics part, and the momentum each
   side's one-step update implies;
5. the update (``update``): the first optimizer-state slot that parts, and what the update's size
   implies (``implied``);
6. ``none``: nothing parts on the first step; ``unlocated``: it was not run or not observable, and why.

It runs on MISMATCH, and on MATCH when ``RunConfig.locate`` asks (``attach``, called by ``judge``).
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np

from equivalence.core.compare import compare
from equivalence.core.compare.location import ROOT, Location, Unplaced, Where, read
from equivalence.core.compare.location import STAGES as STAGE_NAMES
from equivalence.core.compare.rule import MEASURED_FLOOR
from equivalence.core.locate import averages, collectives, forward, slots, stages, upgrade
from equivalence.core.locate.first_step import Recorder
from equivalence.core.measure import clock
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Plan, Run
from equivalence.core.record.intercept import NOT_MODULES
from equivalence.core.record.pairing import pairs
from equivalence.core.run.inputs import Inputs
from equivalence.core.state import states

WARMUP = 'the first update is 0'  # what a 'none' at step 1 says under a warmup from 0
METRICS_ONLY = 'not located: only metrics the steps report part, the training agrees: a step computes them otherwise'


TRAINING = ('forward', 'loss', 'backward', 'update')  # stages that say the training itself differs


def stages_for(failed: frozenset) -> frozenset:
    """The stages a place may be in, given the groups of the leaves the verdict found outside their floors
    (``failed``, after the whole run; empty: a MATCH, located on request, where every stage may be).
    One answer: a place in the forward pass, the loss, the backward pass or the update says the training
    differs, which parameters and optimizer state that agree after every call deny; so where only the EMA
    differs the place is the EMA, where only running statistics do, the statistics, and where only the
    reported losses do, the loss (or the pmap step's own collective on it)."""
    if not failed:
        return frozenset((*TRAINING, 'statistics', 'ema', 'collective'))
    allowed = set()
    if failed & {'params', 'opt_state', 'first_step', 'step', 'trend'}:
        allowed |= {*TRAINING, 'statistics', 'ema', 'collective'}
    if 'losses' in failed:
        allowed |= {'forward', 'loss', 'collective'}
    if 'model_state' in failed:
        allowed.add('statistics')
    if 'ema' in failed:
        allowed.add('ema')
    return frozenset(allowed)


STAGES = (  # (what each stage is, the function), in the order the first step runs them
    ('forward', forward.forward), ('loss', stages.loss), ('backward', stages.backward),
    ('statistics', averages.statistics), ('update', slots.update), ('ema', averages.ema),
)  # fmt: skip


def judge_step(
    port_kind: Kind, results: dict, raw: dict, mapping: dict[str, str], variables: dict, at: int = 1, start=None,
    noisy=frozenset(), allowed: frozenset = stages_for(frozenset()), exact: bool = True, prior=None,
) -> Location:  # fmt: skip
    """The first place the recorded first steps part (``results`` and ``raw`` of ``recorded_run.first_steps``);
    ``at`` > 1: the records of step ``at`` (its last) and the state after it, ``start`` the pmap side's
    parameters before it (NNX paths; nothing parted before it, where ``exact``; else only on the steps
    recorded before); ``noisy``: the parameters the verdict found noise-dominated, never the place;
    ``allowed``: the stages the verdict's leaves leave possible (``stages_for``)."""
    paired = pairs(raw.get('legacy', {}), raw.get('new', {}), mapping, port_kind.port.names)
    modules = stages.modules_of(raw, paired) if paired else []
    step = stages.Step(port_kind, results, raw, mapping, variables, modules, paired, at, start, noisy, prior)
    notes = _notes(port_kind, raw, paired, 'twin' in results)
    legacy = results.get('legacy')
    pmap_side = None if legacy is None or at > 1 or 'collective' not in allowed else (
        collectives.gradients_not_averaged(legacy.raw, port_kind.port.legacy_groups
                                           or states.legacy_groups)
        or collectives.loss_not_averaged(legacy.device_losses, results['new'].losses)
    )  # fmt: skip
    if pmap_side is not None:
        return dataclasses.replace(pmap_side, modules=tuple(modules), notes=tuple(n.text for n in notes))
    agreed = ['collective'] if legacy is not None and at == 1 and 'collective' in allowed else []
    for name, stage in STAGES:
        if name not in allowed:
            continue
        found = stage(step)
        if found is None and (name != 'backward' or step.grads('legacy')):  # gradients not observed: not judged
            agreed.append(name)
        moved = _starts_apart(results, at, noisy) if found is not None and at > 1 and name in TRAINING[:3] else None
        if moved:  # the step starts from parameters that differ: what parts in it may follow from them
            # no module is named: what parts there may follow from the parameters, not be the place (issue 60)
            part = {'forward': 'forward pass', 'backward': 'backward pass'}.get(name, name)
            text = (f'not located: on step {at} its {part} parts, but the parameters it starts from differ already, '
                    f'within their floors ({moved[0]} {moved[1]:.2e} apart), after the update of step {at - 1}: what '
                    'parts in its forward pass, loss or backward pass may follow from them')  # fmt: skip
            return Location('unlocated', '', '', text, tuple(modules), notes=tuple(n.text for n in notes),
                            why=Unplaced.STARTS_APART, read=read(step=at, leaf=moved[0], apart=moved[1],
                                                                 parted=found.new))  # fmt: skip
        if found is not None and stage is stages.loss and any(note.tag == UNOBSERVED for note in notes):
            agreed = [a for a in agreed if a != 'forward']  # not observed: not judged
            found = Location('unlocated', '', '', f'the first loss parts ({found.figures}), and the forward pass '
                             'was not observed on both sides: not localised further',
                             why=Unplaced.UNOBSERVED, read=found.read)  # fmt: skip
        if found is not None:
            said = [note.text for note in notes if stage is slots.update or note.tag != LOOP_GRADS]
            figures, values = found.figures, found.read
            if at > 1:
                zero = _first_update_is_0(results, variables, mapping)
                warmup = "; step 1's update is 0, as warmup gives" if zero else ''
                before = 'nothing parts before it' if exact else 'nothing parted on steps 1 and 2'
                figures = f'{"on" if exact else "by"} step {at} ({before}{warmup}): {figures}'
                values = read(step=at, exact=exact, first_update_zero=zero) + values
            return dataclasses.replace(found, figures=figures, modules=tuple(modules), notes=tuple(said),
                                       agreed=tuple(agreed), read=values)  # fmt: skip
    checked = 'the loss, the gradients, ' if step.grads('legacy') else 'the loss, '
    later = f'whatever parts does so after step {at}' if at > 1 else 'whatever parts does so later'
    if at == 1 and slots.update_is_zero(step):
        later = f'{WARMUP} (a schedule at 0 on step 1, as warmup gives): an optimizer that differs shows later'
        if not step.grads('legacy') and slots.holds_first_moments(step.held('opt_state'), step.held('params')):
            later += " (this loop port's gradients are not observed; its first moments, which hold them, agree)"
        elif not step.grads('legacy'):
            later += (
                ', and so may gradients that differ (a training loss the reported loss does not show, the backward '
                "pass): this loop port's gradients are not observed, and no first moment holds them"
            )
    first = 'the first step' if at == 1 else f'steps 1 to {at}'
    unseen = [f' (not {m.legacy} ↔ {m.new}, whose arrays do not compare: the loss reads it)' for m in modules
              if not (m.input_ok and m.output_ok)]  # the outermost call, its arrays apart  # fmt: skip
    return Location(
        'none', '', '',
        f'nothing parts on {first}: {len(modules) - len(unseen)} module calls{"".join(unseen[:1])}, {checked}the '
        f'statistics, the parameters and the optimizer state are within their floors; {later}',
        tuple(modules), None, tuple(note.text for note in notes), tuple(agreed),
    )  # fmt: skip


UNOBSERVED, UNPAIRED, NO_TWIN, LOOP_GRADS = 'unobserved', 'unpaired', 'no twin', 'loop grads'


class Note(NamedTuple):
    """What was not paired or not observed: its tag (``UNOBSERVED``, ...), and how the report says it."""

    tag: str
    text: str


def _notes(port_kind: Kind, raw: dict, paired: dict, twin_ran: bool) -> list[Note]:
    """What was not paired or not observed, and why."""
    notes = []
    calls = {side: [label for label in raw.get(side, {}) if label not in NOT_MODULES] for side in ('legacy', 'new')}
    for side, what in (('legacy', 'the pmap step called no linen'), ('new', 'the new step called no flax')):
        if not calls[side]:
            text = f'not observed: {what} module the suite could intercept (an opaque or precompiled function, or '
            notes.append(Note(UNOBSERVED, text + 'no flax module): its forward pass is not localised'))
    left = [label for label in calls['legacy'] if label not in paired]
    if calls['legacy'] and calls['new'] and left:
        shown = ', '.join(label or ROOT for label in left[:4]) + (f' and {len(left) - 4} more' if len(left) > 4 else '')
        notes.append(Note(UNPAIRED, f'{len(paired)} of {len(calls["legacy"])} linen module calls paired with new '
                          f'ones ({len(calls["new"])} recorded); not paired: {shown}'))  # fmt: skip
    if not twin_ran:
        text = 'no twin in this process: each value is held to 8 float32 spacings of its largest value'
        notes.append(Note(NO_TWIN, text))
    if port_kind.first_step_probe() is None:  # its gradients are its own step's
        notes.append(Note(LOOP_GRADS, "a loop port's gradients are its own step's: not observed (its first moment, "
                          'which holds them after one step, is read for them)'))  # fmt: skip
    return notes


MAX_STEPS = 8  # the most steps recorded to find the first that parts


@dataclasses.dataclass(frozen=True)
class Seen:
    """What the verdict measured of the checked runs, which a place must agree with: each side's first
    loss (a recording that does not reproduce it parts by itself), the parameters it found
    noise-dominated (never the place), and what was not finite."""

    first_losses: dict = dataclasses.field(default_factory=dict)  # 'legacy', 'new' -> the run's first loss
    noisy: frozenset = frozenset()  # parameter paths (the new side's names)
    nonfinite: Any = None  # findings.NonFinite: where a NaN or Inf appeared (None: none)
    failed: frozenset = frozenset()  # the groups of the leaves outside their floors ('params', 'ema', ...)
    data_step: int | None = None  # the first step whose batch holds NaN or Inf


def locate(port_kind: Kind, config: Run, inputs: Inputs, recorder: Recorder, seen: Seen | None = None) -> Location:
    """Where the first step parts (``inputs``: the checked runs' inputs; ``recorder``: their first step,
    recorded once, shared with the gradient probe; ``seen``: what the verdict measured). Where
    nothing parts on step 1, the checked runs' first steps (up to ``MAX_STEPS``) are recorded again, the
    first whose parameters part is found, and that step is judged as step 1 was: a warmup whose first
    update is 0 hides an optimizer's eps or nesterov on step 1, a schedule that differs later shows
    where it starts. A recording that does not reproduce the run it records names no place."""
    seen, mapping = seen or Seen(), inputs.mapping
    noisy, allowed = seen.noisy, stages_for(seen.failed)
    if seen.data_step is not None:
        return Location('unlocated', '', '', f'not located: the batch of step {seen.data_step} holds NaN or Inf, on '
                        'both sides; what each side makes of it is the non-finite line above',
                        why=Unplaced.DATA_NOT_FINITE)  # fmt: skip
    if seen.failed and seen.failed <= {'metrics'}:  # nothing the training holds parts: no step to record
        return Location('unlocated', '', '', METRICS_ONLY, why=Unplaced.METRICS_ONLY)
    apart = not_reproduced(recorder.runs[0], seen)
    if apart:
        return Location('unlocated', '', '', f'not located: {apart}', why=Unplaced.NOT_REPRODUCED)
    found = judge_step(port_kind, *recorder.runs, mapping, inputs.variables, noisy=noisy, allowed=allowed)
    steps = min(MAX_STEPS, sum(jax.tree.leaves(call)[0].shape[0] for call in inputs.calls))
    if found.kind != 'none' or steps < 2:
        return found
    prior = recorder.runs[0]['legacy'].final.get('opt_state')  # the slots step 2 starts from
    for n in sorted({2, steps}):  # step 2 first: where a warmup's zero first update hid the slip, one run
        results, raw = recorder.steps(n)
        at = _first_parting(results, n, noisy)
        if at is not None:
            break
        start = results['legacy'].params_per_call[n - 2]
        found = judge_step(port_kind, results, raw, mapping, inputs.variables, at=n, start=start, noisy=noisy,
                           allowed=allowed, exact=n == 2, prior=prior if n == 2 else None)  # fmt: skip
        if found.kind != 'none':  # the parameters agree and the EMA or the statistics do not, by step n
            return found
    if at is None:
        return found
    if at < n:
        results, raw = recorder.steps(at)
    start = results['legacy'].params_per_call[at - 2] if at > 1 else None
    return judge_step(port_kind, results, raw, mapping, inputs.variables, at=at, start=start, noisy=noisy,
                      allowed=allowed, prior=prior if at == 2 else None)  # fmt: skip


def not_reproduced(results: dict, seen: Seen) -> str:
    """'' when each recorded side's first loss is its checked run's, to the rounding that compiling the
    step alone (K = 1, with the recording in it) may change: ``MIN_ULPS`` float32 spacings; else which
    side's recording computes something else (a transform the recording does not follow, a step that
    reads the recording's own state): then nothing it recorded may name a place."""
    for side, ran in seen.first_losses.items():
        recorded = results.get(side)
        if recorded is None or not len(recorded.losses) or ran is None:
            continue
        a, b = float(ran), float(recorded.losses[0])
        if not (np.isfinite(a) and np.isfinite(b)):
            continue
        if abs(a - b) > MEASURED_FLOOR.min_ulps * compare.spacing32(max(abs(a), abs(b))):
            name = 'pmap' if side == 'legacy' else 'new'
            return (f"the {name} side's first step, recorded module by module, does not reproduce its run (loss "
                    f'{b:.9g}, where the run had {a:.9g}): the recording computes something else, and nothing it '
                    'recorded is evidence')  # fmt: skip
    return ''


def _first_parting(results: dict, steps: int, noisy=frozenset()) -> int | None:
    """The first step (1-based) after which the parameters part, each held to its floor; None: none."""
    sides = [results.get(side) or results['new'] for side in ('legacy', 'new', 'twin')]
    for j in range(steps):
        trees = (r.params_per_call[j] for r in sides)
        if any(not leaf.ok for leaf in stages.held(*trees, siblings=True, noisy=noisy).values()):
            return j + 1
    return None


def _starts_apart(results: dict, at: int, noisy=frozenset()) -> tuple[str, float] | None:
    """None where both sides start step ``at`` from the same parameters, bit for bit (a warmup's zero first update
    leaves them so); else ``(the leaf that differs most, by how much)``. Within their floors, such parameters
    part a module's output beyond its own (lm1b's Adam eps, tried blind: 'module at Embed_0 ... on step 3
    (nothing parts before it)', the embedding's own weights 3.1e-05 apart after step 2). The noise-dominated
    parameters (``noisy``) are left out: the twin starts that step as far from the new side on them, so the
    module floors of that step hold what follows from them (a bias before BatchNorm: a user's warmup slip was
    'on step 8 module at bn1 parts, but ... conv2/bias 6.83e-03 apart', issue 60)."""
    before = [results[side].params_per_call[at - 2] for side in ('legacy', 'new')]
    gaps = {k: float(np.max(np.abs(np.asarray(before[0][k], np.float64) - np.asarray(v, np.float64)), initial=0.0))
            for k, v in before[1].items()
            if k in before[0] and np.shape(before[0][k]) == np.shape(v) and not stages.owned_by(k, noisy)}  # fmt: skip
    worst = max(gaps, key=gaps.get, default=None)
    return (worst, gaps[worst]) if worst is not None and gaps[worst] > 0 else None


def _first_update_is_0(results: dict, variables: dict, mapping: dict[str, str]) -> bool:
    """Whether the pmap side's first step moved no parameter."""
    start = stages.initial_params(variables, mapping)
    after = results['legacy'].params_per_call[0]
    return all(np.array_equal(after[k], start[k]) for k in after if k in start)


def attach(verdict, port_kind: Kind, plan: Plan, inputs: Inputs, recorder: Recorder, seen: Seen | None = None):
    """``verdict`` (``rule.Verdict``) with its ``location``: on MISMATCH, or on MATCH when ``plan.judging.locate``
    asks (never when it is False); where it cannot run (several processes, after --resume-at) or raises, the
    location says so and the verdict stands."""
    asked, config = plan.judging.locate, plan.run
    if asked is False or (verdict.match and not asked):
        return verdict
    cannot = inputs.first_steps_unrecorded()
    if cannot:
        unrun = Location('unlocated', '', '', f'not run: {cannot}', why=Unplaced.NOT_RUN)
        return dataclasses.replace(verdict, location=unrun)
    if verdict.kind == 'bookkeeping':  # leaves on one side only: no number parts, so no place does
        return dataclasses.replace(verdict, location=Location('unlocated', '', '', 'not located: nothing numeric '
                                   'differs; the leaves on one side only are the diagnosis above',
                                   why=Unplaced.BOOKKEEPING))  # fmt: skip
    try:
        with clock.stage('where the sides part (the first step recorded, module by module)'):
            found = locate(port_kind, config, inputs, recorder, seen)
    except Exception as e:  # noqa: BLE001 -- the verdict stands; the location says why there is none
        found = Location('unlocated', '', '', f'the locating run raised {type(e).__name__}: {str(e)[:200]}',
                         why=Unplaced.RAISED, read=read(raised=type(e).__name__, message=str(e)[:200]))  # fmt: skip
    ruled_out = tuple(s for s in STAGE_NAMES if s not in stages_for(seen.failed)) if seen is not None else ()
    if verdict.match:
        found = unconfirmed(found)
    elif inputs.recorded is not None and (versions := inputs.recorded.other_jax()):
        again = lambda today, saw: locate(port_kind, config, today, Recorder(port_kind, config, today, recorder.twin),  # noqa: E731
                                          saw)  # fmt: skip
        found = upgrade.across_versions(found, inputs, seen or Seen(), versions, again)
    if (
        not verdict.match and found.kind == Where.NONE
    ):  # the final leaves part, no recorded step does: no rounding shown
        found = found.unplaced(f'not located: {found.figures}; yet the final leaves part: what parts does so after '
                               "the steps recorded, or adds up below each step's floor", Unplaced.LATER)  # fmt: skip
    return dataclasses.replace(verdict, location=dataclasses.replace(found, ruled_out=ruled_out))


def unconfirmed(found: Location) -> Location:
    """A MATCH's location names no place: every leaf the verdict held is within its floor, the first step's
    module calls too where it held them, so a place that the located recording alone parts at is no evidence
    the verdict has (diffusion_distillation's correct loop port, ``--locate``: '105 module calls within their
    floors', MATCH, then 'where: module at up_1.attn_1/norm ... it computes something else'). It says what parted
    and that no leaf of the verdict confirms it."""
    if found.kind.stage is None:
        return found
    place = found.new if found.kind != 'update' else f'the update ({found.new})'
    figures = (f'not located: the verdict is a MATCH (every leaf within its floor); the recorded first step parts at '
               f'{found.kind} {place} ({found.figures}), which no leaf of the verdict confirms')  # fmt: skip
    return found.unplaced(figures, Unplaced.MATCH_UNCONFIRMED)
