"""The verdict's policy, as one straight plan (``judge``): the fixed screen, the twins (``twin``), every
leaf against its measured floor, the pmap side's own twin (``legacy_twin``), the first step's gradients
(``first_step``), the diagnosis (``rule``), where the sides part (``locate``), NOT VERIFIED
(``unverified``). Each step returns what it found; nothing is written into shared objects.

What runs, by ``RunConfig.verdict``:

- ``measured`` (default): the twin (``twin.run_twin``), then every leaf and the first step's
  loss against its floor. On MISMATCH only: the first step's gradients (model ports: those each
  optimizer was given in the recorded first steps, ``probe``'s where those cannot run);
  when the first step agrees, the legacy twin (``legacy_twin``: the pmap side on another device
  count), whose spread can widen each leaf's floor; when the first step differs and the port has
  Dropout, a deterministic re-run.
- ``strict``: as measured, and the first step's gradients always (a model port), so that a
  backward-pass slip fails even when the loss and the final state hide it.
- ``screen``: the fixed tolerance of ``compare.FLOAT32_REDUCTION_ORDER``; the twin runs only
  when the screen fails, to adjudicate (a correct but ill-conditioned port still MATCHes).

With several processes every process runs the twins that fit on its own devices, on the
whole batch (``twin``), and judges by process 0's, so all reach the same verdict; the gradient
probe, the legacy twin and the deterministic re-run stay single-process (they run the pmap side
again, over every process's devices), as does the masked-loss hint. After ``--resume-at`` the
twin restores the same checkpoint; the probe, the legacy twin and the re-run, which start from
the initial state, are not run.
A twin that cannot run in this process (code pinned to a mesh built from ``jax.devices()``, or a
count this process does not see) runs in a fresh process that sees its count (``verdict.fresh``);
a loop port's twin must draw the random numbers the run draws (``draws``). Where no twin measures,
the run is NOT VERIFIED with the twin's own reason (``unverified.unmeasured``), unless a MISMATCH needs no floor.

A MISMATCH also says where the sides part on the first step (``locate.attach``: the first module,
loss, gradient, statistic or optimizer slot that leaves its floor), and so does a MATCH when
``RunConfig.locate`` asks.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from equivalence.core.compare import compare, rule
from equivalence.core.compare import findings as found
from equivalence.core.compare.findings import Finding, NoTwin, Probe
from equivalence.core.compare.location import Where
from equivalence.core.compare.outcome import Outcome
from equivalence.core.compare.rule import MEASURED_FLOOR, Verdict
from equivalence.core.judge.runs import Runs
from equivalence.core.locate import first_step, hidden, locate
from equivalence.core.locate.first_step import Recorder
from equivalence.core.measure import clock
from equivalence.core.port.config import RunConfig
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Plan
from equivalence.core.rng import randomness
from equivalence.core.run import nudge, sides
from equivalence.core.run.inputs import Inputs
from equivalence.core.run.sides import PathResult
from equivalence.core.state import convert, states
from equivalence.core.trend import systematic
from equivalence.core.twins import fresh, legacy_twin, twin, unverified
from equivalence.core.twins.unverified import start_params


def judge(kind: Kind, plan: Plan, old, new, inputs: Inputs, tree, runs: Runs, diagnose: bool = True):
    """``(the report every leaf is judged by, the verdict)``; ``tree(path)`` is what of a path's result is
    compared (``compared``); ``plan``: its run and judging parts; ``runs``: what runs the twins and probes the policy
    asks for (``Runs``);
    ``diagnose=False``: a MISMATCH is neither diagnosed nor located."""
    trees = lambda path, first=None: {**tree(path), **(first or {})}  # noqa: E731
    screen = compare.compare(trees(old), trees(new), kind.port.tolerance)
    done: list = [found.Screen(screen.match)]
    run, judging = plan.run, plan.judging
    local, cannot = len(jax.local_devices()), fresh.why_not(run, inputs.restore is not None)
    counts = tuple(
        n for n in twin.twin_kinds(run, judging.twin, local if cannot else max(local, 2))
        if twin.devices_of(n, run) <= local or not cannot
    )  # fmt: skip
    if not counts or (judging.verdict == 'screen' and screen.match):
        none = NoTwin(NoTwin.Why.NO_MESH, cannot) if not counts else NoTwin(NoTwin.Why.SCREEN_PASSED)
        report, judged = finish(kind, plan, screen, old, new, inputs, done + [none], none, runs, None, diagnose)
        return report, unverified.unmeasured(report, judged) if not counts else judged  # --verdict screen: the user's
    measured = runs.twins(new, counts)
    if not measured.twins:
        why = NoTwin(NoTwin.Why.TWIN, measured.why[0])
        report, judged = finish(kind, plan, screen, old, new, inputs, done + [why], why, runs, None, diagnose,
                                measured.errors)  # fmt: skip
        return report, unverified.unmeasured(report, judged)
    twins = measured.twins
    first = [rule.first_step_tree(float(p.losses[0])) for p in (old, new)]
    floor = twin.farthest(
        trees(new, first[1]),
        [twin.measuring(n, trees(tw, rule.first_step_tree(float(tw.losses[0])))) for n, tw in twins.items()],
    )
    start = old.start if old.start is not None else start_params(inputs.variables, inputs.mapping)
    report = compare.compare_to_floor(trees(old, first[0]), trees(new, first[1]), floor, MEASURED_FLOOR, None, start)
    on = found.Twins(tuple(twins), jax.process_count(), measured.fresh)
    memory = {'run': new.memory, 'twins': {twin.label(k): tw.memory for k, tw in twins.items()}}
    done += [on, found.Memory(memory['run'], memory['twins'])]
    done += [NoTwin(NoTwin.Why.TWIN, reason) for reason in measured.why]  # those not run, or refused
    recorder = runs.recorder(first_step.here(next(iter(twins)), run, measured.fresh))
    grads, errors = None, measured.errors
    if legacy_twin.wanted(report, old, new):
        grads, other, lines, raised = legacy_floor(kind, old, new, inputs, twins, runs, recorder)
        done, errors = done + lines, errors + raised
        if other is not None:
            ref_twin = trees(other, rule.first_step_tree(float(other.losses[0])))
            report = compare.compare_to_floor(
                trees(old, first[0]), trees(new, first[1]), floor, MEASURED_FLOOR, ref_twin, start
            )
        if grads is not None:
            report = dataclasses.replace(report, leaves=[*report.leaves, *grads.leaves])
    reading = trends(old, new, twins, inputs, report, start, run.steps_per_call)
    if reading.decisive:  # a difference that grows every call as a slip in the update does, below the floors
        report = dataclasses.replace(report, leaves=[*report.leaves, *systematic.leaves(reading)])
    report, judged = finish(kind, plan, report, old, new, inputs, done, on, runs, recorder, diagnose, errors, grads,
                            reading)  # fmt: skip
    judged = unverified.unverified(kind.port, inputs, report, judged)
    judged = unverified.thin(judged, reading)
    if judged.match:
        steps = len(old.params_per_call) * run.steps_per_call
        judged = dataclasses.replace(judged, sensitivity=systematic.sensitivity(report, old.params_per_call, start,
                                                                                 steps))  # fmt: skip
    return report, dataclasses.replace(judged, memory=memory)


def trends(old, new, twins: dict, inputs: Inputs, report: compare.Report, start: dict, k: int) -> systematic.Reading:
    """What the parameters after every call show beyond their floors (``systematic.read``): each twin read beside
    the run from its own start (the run's own program from parameters one spacing off starts there). None after
    ``--resume-at``, whose calls start from a checkpoint."""
    if inputs.restore is not None or not old.params_per_call:
        return systematic.Reading()
    new_start = start_params(inputs.variables, inputs.mapping)
    own = []
    for n, tw in twins.items():
        moved = isinstance(n, nudge.Nudged) and n.params
        own.append((tw.params_per_call, start_params(nudge.variables(inputs.variables, n.draw), inputs.mapping)
                    if moved else new_start))  # fmt: skip
    noisy = frozenset(leaf.path for leaf in report.leaves if leaf.group == 'params' and leaf.noise_dominated)
    try:
        return systematic.read(old.params_per_call, new.params_per_call, {**new_start, **start}, own, noisy, k)
    except Exception:  # noqa: BLE001 -- a reading beside the floors, never an error in place of the verdict
        return systematic.Reading()


def legacy_floor(kind: Kind, old, new, inputs: Inputs, twins: dict, runs: Runs, recorder: Recorder):
    """``(first-step gradients or None, the legacy twin's PathResult or None, what ran, what raised)``. A
    model port's first-step gradients are probed first: when they differ the difference is math, which no
    chaos excuses, and no legacy twin runs (nor may it hide a backward-pass slip)."""
    cannot = inputs.first_steps_unrecorded()  # a reference holds the pmap side's first steps and its twin
    if cannot:
        return None, None, [found.LegacyTwin(found.LegacyTwin.Ran.NOT_RUN, why=cannot)], ()
    grads, done, probe = None, [], kind.first_step_probe()
    if probe is not None:
        with clock.stage("first-step gradients (each side's first step recorded)"):
            grads = probe(recorder)
        done.append(found.Probed(Probe.GRADS, grads.match))
        if not grads.match:
            return grads, None, done, ()
    with clock.stage('legacy twin (the pmap side on another device count)'):
        other, said, raised = runs.legacy_twin(old, new, twins)
    return grads, other, [*done, said], raised


def finish(kind: Kind, plan: Plan, report, old, new, inputs: Inputs, done: list, twin_record, runs: Runs, recorder,
           diagnose: bool,
           errors: tuple = (), grads=None, reading=None) -> tuple[compare.Report, Verdict]:  # fmt: skip
    """Gradients (strict, or to diagnose; ``grads`` if already probed), the diagnosis on MISMATCH, and
    where the sides part: ``(the report, with the gradients' leaves, the verdict)``."""
    cannot, unrecorded = inputs.single_process_probes(), inputs.first_steps_unrecorded()
    recorder = recorder or runs.recorder(None)
    probe = kind.first_step_probe()
    # on MISMATCH the gradients are probed to diagnose; with no floor, diagnosed or not, they decide the outcome
    # (differing gradients are math, a MISMATCH; agreeing ones leave it UNMEASURED, NOT VERIFIED)
    asked = not report.match and (diagnose or report.floor is None)
    judging = plan.judging
    if grads is None and probe is not None and (judging.verdict == 'strict' or asked):
        if unrecorded:
            done = [*done, found.NotRun(Probe.GRADS, unrecorded)]
        else:
            with clock.stage("first-step gradients (each side's first step recorded)"):
                grads = probe(recorder)
            report = dataclasses.replace(report, leaves=[*report.leaves, *grads.leaves])
            done = [*done, found.Probed(Probe.GRADS, grads.match)]
    noisy, errors = tuple(leaf for leaf in report.leaves if leaf.noise_dominated), tuple(errors)
    seen = locate.Seen(
        {'legacy': float(old.losses[0]), 'new': float(new.losses[0])}
        if inputs.restore is None and old is not None and new is not None
        else {},
        frozenset(leaf.path for leaf in noisy if leaf.group == 'params'),
        failed=frozenset(leaf.group for leaf in report.leaves if not leaf.ok),
    )
    if hidden.needed(report, seen) and judging.verdict != 'screen':
        # a MATCH these leaves leave unverified where the hold cannot run (several processes, resumed) or was
        # not asked for (``locate=False``, ``diagnose=False``: the library's), said so
        skipped = unrecorded or ('locate=False' if judging.locate is False else '' if diagnose else 'diagnose=False')
        if skipped:
            done = [*done, found.NotRun(Probe.HELD, skipped)]
        else:
            with clock.stage('the first step held module by module (noise-dominated leaves cannot verify)'):
                extra, said = hidden.first_step_leaves(recorder, seen)
            report, done = dataclasses.replace(report, leaves=[*report.leaves, *extra]), [*done, said]
            seen = dataclasses.replace(seen, failed=seen.failed | {leaf.group for leaf in extra})
    outcome = Outcome.MATCH if report.match else Outcome.MISMATCH  # NOT VERIFIED: ``unverified``, after
    judged = Verdict(outcome, judging.verdict, tuple(done), twin=twin_record, noise_dominated=noisy, errors=errors)
    if report.match:
        return report, locate.attach(judged, kind, plan, inputs, recorder, seen)  # only when --locate asks
    nonfinite = rule.nonfinite(
        {'legacy': old.losses, 'new': new.losses},
        {'legacy': old.final, 'new': new.final},
        first_step.data_nonfinite(inputs.whole_calls),
    )
    no_floor = twin_record if report.floor is None else None
    if not diagnose:  # only its outcome is read: no gradients probed, no re-run, not located
        # With no floor, a MISMATCH that nothing floor-free explains (NaNs, bookkeeping, the first step) is
        # UNMEASURED, NOT VERIFIED (``unverified.unmeasured``), as it is when diagnosed: the outcome is the same.
        reading = rule.diagnose(report, nonfinite, None, grads is not None, no_floor)
        return report, dataclasses.replace(judged, diagnosis=reading) if reading.kind is Finding.UNMEASURED else judged
    rerun = None
    # Only a first *loss* that differs can be re-checked with dropout off (the re-run compares
    # losses): a slip seen only in the first gradients is math, whatever dropout does.
    loss_failed = any(leaf.name == 'first_step/loss' for leaf in rule.failed(report, 'first_step'))
    dropout = loss_failed and runs.dropout
    if dropout and cannot:
        done = [*done, found.NotRun(Probe.RERUN, cannot)]
    elif dropout:
        with clock.stage('deterministic re-run (dropout off)'):
            rerun = runs.rerun(report)
        done = [*done, found.Probed(Probe.RERUN, bool(rerun))]
    diagnosed = rule.diagnose(report, nonfinite, rerun, grads is not None, no_floor)
    mismatch = dataclasses.replace(judged, done=tuple(done), diagnosis=diagnosed)
    data_step = nonfinite.data_step if nonfinite is not None else None
    seen = dataclasses.replace(seen, nonfinite=nonfinite, data_step=data_step)
    located = locate.attach(mismatch, kind, plan, inputs, recorder, seen)
    parts = bool(rule.failed(report, 'first_step'))
    if reading is not None and reading.decisive and systematic.may_place(located.location, parts):
        ranks = frozenset(np.ndim(a) for a in (old.params_per_call or [{}])[-1].values())
        located = dataclasses.replace(located, location=systematic.location(reading, ranks))
    place = Where(located.location.kind) if located.location is not None else None
    stage = place.stage if place is not None else None
    # the place the records found, which the diagnosis from the final leaves or a re-run must not contradict
    if (diagnosed.kind in (Finding.UPDATE, Finding.OPTIMIZER) and stage in rule.EARLIER) or (
        diagnosed.kind is Finding.RANDOMNESS and place in rule.COMPUTED
    ):
        reading = rule.diagnose(report, nonfinite, rerun, grads is not None, no_floor, placed=stage, place=place)
        located = dataclasses.replace(located, diagnosis=reading)
    return report, located


@dataclasses.dataclass
class RunResult:
    config: RunConfig
    legacy: PathResult
    new: PathResult
    report: compare.Report
    resumed_at: int = 0  # NNX resumed from a checkpoint of this step: losses and divergence cover the steps after it
    notes: list[str] = dataclasses.field(default_factory=list)  # lines the report prints under its header
    verdict: Any = None  # rule.Verdict: what was measured and, on MISMATCH, the diagnosis (judge)
    programs: tuple[str, str] = ('pmap(scan)', 'NNX sharded scan')  # how each side ran its K steps (header)
    new_side: str = 'NNX'  # what the new side is: 'NNX', or 'linen under jax.jit' (kind.new_side)
    keys: str = ''  # how the steps get their keys (kind.keys): the --rng mode, or that they take none
    timing: dict | None = None  # what each stage cost (clock.Clock.summary): wall, compile seconds, programs
    device: Any = None  # run.precision.Device: the backend, its devices and the precision the check computed at

    @property
    def outcome(self) -> Outcome:
        """The check's outcome, as its verdict decided it (``rule.Verdict.outcome``)."""
        return self.verdict.outcome

    def param_divergence(self) -> list[float]:
        """Max |nnx - legacy| over all parameters, after each call."""
        pairs = zip(self.legacy.params_per_call, self.new.params_per_call, strict=True)
        return [max(float(np.abs(a[k] - b[k]).max()) for k in a) for a, b in pairs]


def judged(kind: Kind, plan: Plan, old: PathResult, new: PathResult, inputs: Inputs, runs: Runs,
           diagnose: bool = True) -> tuple[compare.Report, Verdict, list[str]]:  # fmt: skip
    """``(the report, the verdict, its notes)``: the two runs judged against their measured noise floor (``judge``),
    the twins and probes run by ``runs``; ``diagnose``: False where only the match is read (no diagnosis nor location
    on MISMATCH). Its notes: what was left out of the comparison (``compared``)."""
    tree, notes = compared(kind, old, new)
    report, verdict = judge(kind, plan, old, new, inputs, tree, runs, diagnose)
    return report, verdict, notes


def compared(kind: Kind, old: PathResult, new: PathResult) -> tuple[Callable[[PathResult], convert.Neutral], list[str]]:
    """How each path's result is compared (losses, the metrics both sides report, the groups both
    states hold), and the lines that say what was left out of it."""
    one_side = sorted((set(old.metrics) ^ set(new.metrics)) - old.left_out)  # left out already: said once, why
    left_out = old.left_out | set(one_side)
    kept = lambda metrics: {p: a for p, a in metrics.items() if p not in left_out}  # noqa: E731
    full = lambda path: sides.with_losses(path.final, path.losses, kept(path.metrics))  # noqa: E731
    # A state that holds no step counter (a tuple (params, opt_state)), or groups the port maps itself without
    # one (its legacy_groups leaving out a global_step field, which is then said not compared: a report that also
    # called it a bookkeeping MISMATCH said both, issue 60), leaves the counter out on both sides, said.
    notes = states.align(full(old), full(new), mapped=bool(kind.port.legacy_groups))[2]

    def tree(path: PathResult) -> convert.Neutral:
        return states.without(full(path), 'step') if notes else full(path)

    lines = [*kind.described(), *old.notes, *new.notes, *notes, *randomness.take_unbridged()]
    lines += [states.Uncompared(f'metrics/{p}', states.Skip.ONE_SIDE,
                                f'only the {"pmap" if p in old.metrics else "new"} step reports it')
              for p in one_side]  # fmt: skip
    return tree, list(dict.fromkeys(lines))
