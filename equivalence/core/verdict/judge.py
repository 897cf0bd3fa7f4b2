"""Turns two finished runs into the measured verdict: twin, first step, diagnosis (``verdict``).

What runs, by ``RunConfig.verdict``:

- ``measured`` (default): the twin (``twin.run_twin``), then every leaf and the first step's
  loss against its floor. On MISMATCH only: the first step's gradients (model ports: those each
  optimizer was given in ``locate``'s recorded first steps, ``probe``'s where those cannot run);
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
the run is NOT VERIFIED with the twin's own reason (``unmeasured``), unless a MISMATCH needs no floor.

A MISMATCH also says where the sides part on the first step (``locate.attach``: the first module,
loss, gradient, statistic or optimizer slot that leaves its floor), and so does a MATCH when
``RunConfig.locate`` asks.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from equivalence.core.port import blame, convert
from equivalence.core.port.config import RunConfig
from equivalence.core.port.kind import Kind
from equivalence.core.port.ports import Port, init_inputs
from equivalence.core.run import draws, footprint, randomness, setups, sides
from equivalence.core.run.sides import PathResult
from equivalence.core.verdict import compare, fresh, legacy_rows, locate, rule, twin
from equivalence.core.verdict.outcome import Outcome
from equivalence.core.verdict.rule import MEASURED_FLOOR, Verdict


@dataclasses.dataclass
class Inputs:
    """What both runs were given: the verdict's re-runs take the same."""

    variables: dict
    calls: list  # this process's rows of each call (all of them with one process)
    rng: jax.Array | None
    restore: Callable | None = None  # --resume-at: loads the checkpoint into a setup, returns the key chain
    first_call: int = 0  # --resume-at: the calls are those from this one on
    whole: list | None = dataclasses.field(default=None, repr=False)  # whole_calls, drawn once
    errors: list = dataclasses.field(default_factory=list)  # the whole text of what a re-run raised (the JSON report)
    first_steps: tuple | None = dataclasses.field(default=None, repr=False)  # locate's, for the probe and location
    fresh_twins: tuple = ()  # the twins that ran in a fresh process: not run again here (locate.here)
    diagnose: bool = True  # False: a MISMATCH is not diagnosed nor located (a nested run whose match alone is read)

    def whole_calls(self, port: Port, config: RunConfig) -> list:
        """The calls with every row of the global batch: the twin runs on this process's devices alone."""
        if jax.process_count() == 1:
            return self.calls
        if self.whole is None:
            self.whole = setups.global_calls(port, config)[self.first_call :]
        return self.whole

    def single_process_probes(self) -> str:
        """Why the probes that re-run both sides cannot run here; '' when they can."""
        if self.restore is not None:
            return 'resumed from a checkpoint'
        return 'several processes' if jax.process_count() > 1 else ''


def judge(kind: Kind, config: RunConfig, old, new, inputs: Inputs, tree) -> tuple[compare.Report, Verdict]:
    """The report every leaf is judged by, and the verdict with its diagnosis; ``tree(path)`` is
    what of a path's result is compared (``sides.compared``)."""
    port = kind.port
    trees = lambda path, first=None: {**tree(path), **(first or {})}  # noqa: E731
    screen = compare.compare(trees(old), trees(new), port.tolerance)
    done = [f'fixed screen {"passed" if screen.match else "failed"}']
    local, cannot = len(jax.local_devices()), fresh.why_not(config, inputs.restore is not None)
    kinds = twin.twin_kinds(config, local if cannot else max(local, 2))
    counts = tuple(n for n in kinds if twin.devices_of(n, config) <= local or not cannot)
    if not counts or (config.verdict == 'screen' and screen.match):
        none = f'no second mesh fits ({cannot or "an odd batch"})' if not counts else ''
        text = f'not run: {none or "--verdict screen, and the screen passed"}'
        judged = finish(kind, config, screen, old, new, inputs, done + [f'twin {text}'], text, None)
        return unmeasured(screen, judged) if none else (screen, judged)  # --verdict screen: the user's choice
    twins, why, fresh_ones = measured_twins(kind, config, new, inputs, counts)
    inputs.fresh_twins = tuple(fresh_ones)
    if not twins:
        judged = finish(kind, config, screen, old, new, inputs, done + [f'twin {why[0]}'], why[0], None)
        return unmeasured(screen, judged)
    first = [rule.first_step_tree(float(p.losses[0])) for p in (old, new)]
    floor = twin.farthest(
        trees(new, first[1]), [trees(tw, rule.first_step_tree(float(tw.losses[0]))) for tw in twins.values()]
    )
    start = start_params(port, inputs.variables)
    report = compare.compare_to_floor(trees(old, first[0]), trees(new, first[1]), floor, MEASURED_FLOOR, None, start)
    on = twin.describe(list(twins))
    on += f' in each of {jax.process_count()} processes' if jax.process_count() > 1 else ''
    if fresh_ones:
        some = f' ({" and ".join(map(str, fresh_ones))} of them)' if len(fresh_ones) < len(twins) else ''
        on += f' in a fresh process{some}'
    done.append(f'every leaf and the first loss held to the floor of {"twins" if len(twins) > 1 else "a twin"} {on}')
    memory = {'run': new.memory, 'twins': {twin.label(k): tw.memory for k, tw in twins.items()}}
    said = footprint.line(memory['run'], memory['twins'])
    done += ([said] if said else []) + [f'twin {reason}' for reason in why]  # those not run, or refused
    grads = None
    if wants_legacy_twin(report, old, new):
        grads, other = legacy_floor(kind, config, old, new, inputs, twins, done)
        if other is not None:
            ref_twin = trees(other, rule.first_step_tree(float(other.losses[0])))
            report = compare.compare_to_floor(
                trees(old, first[0]), trees(new, first[1]), floor, MEASURED_FLOOR, ref_twin, start
            )
        if grads is not None:
            report.leaves.extend(grads.leaves)
    judged = finish(kind, config, report, old, new, inputs, done, on, next(iter(twins)), grads)
    report, judged = unverified(port, inputs, report, judged)
    return report, dataclasses.replace(judged, memory=memory)


def unmeasured(report: compare.Report, judged: Verdict) -> tuple[compare.Report, Verdict]:
    """A run whose noise floor no twin could measure (none fits, each raised or was refused; not the
    user's ``--verdict screen``) is NOT VERIFIED where the floor would decide: a pass of the fixed screen,
    which is no measure of this port's own noise, or a failure of it that nothing tells from noise. A
    MISMATCH decided without a floor (the first step, the bookkeeping, NaNs) stays a MISMATCH."""
    if judged.match:
        screen = "the fixed screen passed, which is not a measure of this port's own noise"
    elif judged.kind == 'unmeasured':
        screen = f'outside the fixed screen, and nothing tells noise from a slip: {rule.details(rule.failed(report))}'
    else:
        return report, judged
    why = f"no twin measured this port's noise floor ({judged.twin}); {screen}"
    return report, dataclasses.replace(judged, match=False, kind='', diagnosis='', unverified=why)


def unverified(port: Port, inputs: Inputs, report: compare.Report, judged: Verdict) -> tuple[compare.Report, Verdict]:
    """A MATCH whose noise-dominated leaves are where a slip would hide made NOT VERIFIED
    (``rule.not_verified``); any other verdict as it is."""
    head = output_layer(port, inputs.variables, inputs.calls[0]) if judged.match else set()
    why = rule.not_verified(report, head) if judged.match else ''
    if not why:
        return report, judged
    return report, dataclasses.replace(judged, match=False, unverified=why, hidden_by_noise=True)


def output_layer(port: Port, variables: dict, batch_KxG) -> set[str]:
    """The paths, as compared (NNX's), of the parameters of the layer the model applies last: the last
    linen module to be called, in an abstract ``init`` on one example of ``batch_KxG``, that holds
    parameters of its own (``head``, ``Dense_1``). Call order, not the order of the variables: a
    pytree operation sorts dict keys."""
    entered: list[str] = []

    def record(next_fun, args, kwargs, context):
        if context.method_name == '__call__':
            entered.append('/'.join(context.module.path))
        return next_fun(*args, **kwargs)

    example = jax.tree.map(lambda v: v[0, :1], batch_KxG)
    key = jax.random.PRNGKey(0)
    args, kwargs = init_inputs(port, example)
    with nn.intercept_methods(record):
        jax.eval_shape(lambda: port.legacy_model().init({'params': key, 'dropout': key}, *args, **kwargs))
    paths = list(convert.flatten(variables.get('params', {})))
    owner = lambda p: p.rpartition('/')[0]  # noqa: E731
    last = next((m for m in reversed(entered) if any(owner(p) == m for p in paths)), None)
    mapping = setups.check_names(port, variables) or {}
    return {mapping.get(p, p) for p in paths if owner(p) == last}


def measured_twins(kind: Kind, config: RunConfig, new, inputs: Inputs, counts: tuple[int, ...]):
    """``({D': the twin's PathResult}, why not, counts run in a fresh process)``: each twin (up to
    ``twin.TWINS``) that ran and computed what NNX computes, its losses and (a loop port's) random draws,
    and why each other did not run or was refused."""
    twins, why, fresh_ones, drawn_by_run = {}, [], [], []
    calls = inputs.whole_calls(kind.port, config)
    fit = new.memory if twin.must_fit(config) else None
    # Where fewer than two candidates fit, data parallel on D runs all the same (it rounds as the pmap run
    # does; the reordered placements alone measured too small a floor: wide under fsdp-tp, seed 0, 11x).
    tries = [(n, fit) for n in counts] + ([(config.devices, None)] if fit is not None else [])
    built: dict = {}  # a candidate's setup, compiled to read its bytes: the fallback runs it as it is
    for n, limit in tries:
        if len(twins) == twin.TWINS or n in twins:
            continue
        try:
            tw, drawn, in_fresh = one_twin(kind, config, inputs, calls, n, limit, built)
        except TwinNotRun as e:
            why.append((n, str(e)))
            continue
        refusal = rule.twin_refusal(new.losses, tw.losses)
        if not refusal and twin.devices_of(n, config) == config.devices:
            refusal = rule.twin_reordered_nothing(new.final, tw.final)
        if not refusal and drawn is not None:
            drawn_by_run = drawn_by_run or [run_draws(kind, config, inputs)]  # once, when a twin needs it
            refusal = draws.refusal(drawn_by_run[0], drawn)
        if refusal:
            why.append((n, f'{refusal} ({twin.describe([n])}{" in a fresh process" if in_fresh else ""})'))
        else:
            twins[n] = tw
            fresh_ones += [n] if in_fresh else []
    return twins, [reason for n, reason in why if n not in twins], fresh_ones  # a fallback that ran: its bytes said


class TwinNotRun(Exception):
    """Why a twin did not run, as the verdict line says it."""


def one_twin(kind: Kind, config: RunConfig, inputs: Inputs, calls: list, n, fit: dict | None = None, built=None):
    """``(the twin's PathResult, its first call's draws or None, whether it ran in a fresh process)``: in
    this process when its devices suffice and the code runs there, else in a fresh process that sees ``n``
    devices (code pinned to a mesh of its own, built from ``jax.devices()``); ``TwinNotRun`` saying why not.
    ``fit``: the run's bytes per device, which a candidate twin must not exceed ``twin.FIT`` times;
    ``built``: setups built already, by twin (one that did not fit may run later as the fallback)."""
    check = checks_draws(kind)
    raised = f'{n} device(s) are more than this process sees'
    if twin.devices_of(n, config) <= len(jax.local_devices()):
        drawn = draws.FirstCall() if check else None
        try:
            built = {} if built is None else built
            setup = built[n] = built.get(n) or kind.twin_setup(config, inputs.variables, n)
            too_big(setup, calls[0], inputs.rng, fit, n)
            tw = twin.run_twin(
                kind, config, inputs.variables, calls, inputs.rng, n, restore=inputs.restore, record=drawn, setup=setup
            )
            return tw, drawn and drawn.draws, False
        except TwinNotRun:
            raise
        except Exception as e:  # noqa: BLE001 -- NNX code pinned to its own mesh cannot run on the twin's
            inputs.errors.append(f'twin on {n} device(s): {type(e).__name__}: {e}')
            raised = f'{twin.describe([n])} it raised {blame.first_line(e)}'
    cannot = fresh.why_not(config, inputs.restore is not None)
    if cannot:
        raise TwinNotRun(f'not run: {raised}; and no fresh process: {cannot}')
    try:
        tw, drawn = fresh.run_twin(kind, config, inputs.variables, calls, inputs.rng, n, check)
    except Exception as e:  # noqa: BLE001 -- the fresh process failed too: both reasons
        inputs.errors.append(f'twin on {n} device(s) in a fresh process: {type(e).__name__}: {e}')
        raise TwinNotRun(f'not run: {raised}; {blame.first_line(e)}') from None
    return tw, drawn, True


def too_big(setup, batch_KxG, rng, fit: dict | None, n) -> None:
    """``TwinNotRun`` when the twin would hold more than ``twin.FIT`` times the run's bytes per device."""
    if fit is None:
        return
    held = footprint.per_device(setup, batch_KxG, rng)
    if held is not None and held['held'] > twin.FIT * fit['held']:
        ratio = held['held'] / fit['held']
        raise TwinNotRun(f"not run {twin.describe([n])}: it would hold {ratio:.2f}x the run's bytes per device")


def checks_draws(kind: Kind) -> bool:
    """Whether a twin's random draws are checked against the run's: where the port's step draws as its
    code says (``kind.checks_draws``: a loop port's; a model port's are drawn by the suite from the run's
    keys, the same by construction), in one process (the run's first call is run again, recording, which
    across processes is collective)."""
    return kind.checks_draws and jax.process_count() == 1


def run_draws(kind: Kind, config: RunConfig, inputs: Inputs) -> draws.Draws:
    """What the NNX run's first call draws: a fresh setup of it (restored from the checkpoint after
    ``--resume-at``), its first call run again while recording (``draws.first_call``)."""
    setup = kind.new_setup(config, inputs.variables)
    rng = inputs.restore(setup) if inputs.restore is not None else inputs.rng
    return draws.first_call(setup, inputs.calls[0], rng)


def wants_legacy_twin(report: compare.Report, old, new) -> bool:
    """Whether the legacy side's own floor could change this verdict: the NNX twins' floor failed
    float leaves that both sides hold (not a counter, a shape or a NaN), with finite losses and the
    first step within its floor (a slip there is math, which no reordering explains), and not only
    running statistics: chaos moves the parameters, and statistics that differ while the parameters
    and losses agree are computed differently (a BatchNorm momentum), not reordered."""
    bad = [leaf for leaf in rule.failed(report) if not leaf.one_sided and leaf.floor is not None]
    finite = np.isfinite(old.losses).all() and np.isfinite(new.losses).all()
    trained = any(leaf.group != 'model_state' for leaf in bad)
    return trained and bool(finite) and not rule.failed(report, 'first_step')


def legacy_floor(kind: Kind, config: RunConfig, old, new, inputs: Inputs, twins: dict, done: list):
    """``(first-step gradients or None, the legacy twin's PathResult or None)``, saying in ``done``
    what ran. A model port's first-step gradients are probed first: when they differ the difference
    is math, which no chaos excuses, and no legacy twin runs (nor may it hide a backward-pass slip)."""
    cannot = inputs.single_process_probes()
    if cannot:
        done.append(f'legacy twin not run: {cannot}')
        return None, None
    grads = None
    if kind.observes_grads:
        grads = first_step_grads(kind, config, inputs, next(iter(twins)))
        done.append(f'first-step gradients {"agree" if grads.match else "differ"}')
        if not grads.match:
            return grads, None
    other, said = legacy_twin(kind, config, old, new, twins, inputs)
    done.append(said)
    return grads, other


def legacy_twin(kind: Kind, config: RunConfig, old, new, twins: dict, inputs: Inputs):
    """``(the legacy twin's PathResult or None, what was done)``: the pmap side again on another device
    count, with the same data and keys: what reordering its own sums does to it. The NNX twins cannot
    see chaos that lives on the legacy side (cnn, global keys, seed 4: legacy on 8 devices ends 1.7e-4
    from legacy on 1, 2 and 4 and from every NNX run, all within 1.5e-6 of each other).

    Refused, like an NNX twin, when it does not compute what the pmap run computes: its losses at
    steps 1 and 2 more than TWIN_ULPS apart (with per-device keys a model port that draws random
    numbers draws them as the run's D devices do: ``legacy_rows``; a loop port's own step draws on the
    n devices' keys, and is judged by these losses), or, after the first call, a spread
    already beyond what the NNX twin allows there (``rule.early_excess``): chaos starts at
    rounding level and grows (seed 4: 5.7e-7 after call 1, NNX's twin 5.5e-7; 1.8e-4 after call 4),
    a pmap program whose math depends on its device count (a gradient psum for pmean under Adam acts
    as eps / D) differs from the first updates on. So it needs two calls or more.

    Another count, not the same step vmapped over the D device rows on one device (which would
    keep per-device keys): that keeps each device's grouping of the batch sums, where this chaos
    is born, and ends 3.3e-7 from legacy on 8 in the seed-4 case above, missing it."""
    counts = twin.twin_counts(config, len(jax.devices()))  # the first NNX twin's count: 1, or 2 on D = 1
    if not counts:
        return None, 'legacy twin not run: no second device count fits'
    n = counts[0]
    if config.calls < 2:
        return None, 'legacy twin not run: with one call there is no early state to tell chaos from a real difference'
    rows = config.rng_mode == 'per-device' and kind.draws_random_numbers()  # drawn as the run's D devices draw
    first = [{'params': tw.params_per_call[0]} for tw in twins.values()]
    twin_first = twin.farthest({'params': new.params_per_call[0]}, first).get('params', {})
    fed, start = compare.feeding_dtypes(old.final), start_params(kind.port, inputs.variables)
    first_call = (new.params_per_call[0], twin_first, MEASURED_FLOOR, fed, start)
    excess = rule.early_excess(old.params_per_call[0], new.params_per_call[0], *first_call)
    if excess:
        why = f'NNX is off after the first call, {excess}: not chaos, which grows from rounding'
        return None, f'legacy twin not run: {why}'
    try:
        on_n = dataclasses.replace(config, devices=n, strategy='dp', mesh=None, nnx_form='split')
        if rows:
            other = legacy_rows.run(kind.port, config, n, inputs.variables, inputs.calls, inputs.rng)
        else:
            other = sides.run_legacy(kind, on_n, inputs.variables, inputs.calls, inputs.rng)
    except Exception as e:  # noqa: BLE001 -- pmap code written for one device count
        inputs.errors.append(f'legacy twin on {n} device(s): {type(e).__name__}: {e}')
        return None, f'legacy twin on {n} device(s) not run: it raised {blame.first_line(e)}'
    refusal = rule.twin_refusal(old.losses, other.losses, 'legacy')
    if not refusal and not np.isfinite(other.losses).all():
        refusal = 'refused: a non-finite loss'
    if not refusal:
        excess = rule.early_excess(old.params_per_call[0], other.params_per_call[0], *first_call)
        refusal = excess and f'refused: after the first call, {excess}: on another count it computes something else'
    if refusal:
        return None, f'legacy twin on {n} device(s) {refusal}'
    keys = f", drawing with the run's {config.devices} per-device keys" if rows else ''
    return other, f"a legacy twin on {n} device(s){keys} measured the pmap side's own floor"


def start_params(port: Port, variables: dict) -> dict[str, np.ndarray]:
    """The parameters both runs started from, named as the comparison names them (NNX's paths)."""
    start = {'params': convert.flatten(variables.get('params', {}))}
    mapping = setups.check_names(port, variables)
    return (convert.rename(start, mapping) if mapping else start)['params']


def finish(kind: Kind, config, report, old, new, inputs, done, twin_text, n_twin, grads=None) -> Verdict:
    """Gradients (strict, or to diagnose; ``grads`` if already probed), the diagnosis on MISMATCH, and
    the verdict."""
    cannot = inputs.single_process_probes()
    to_diagnose = not report.match and inputs.diagnose
    port = kind.port
    if grads is None and kind.observes_grads and (config.verdict == 'strict' or to_diagnose):
        if cannot:
            done.append(f'first-step gradients not probed: {cannot}')
        else:
            grads = first_step_grads(kind, config, inputs, n_twin)
            report.leaves.extend(grads.leaves)
            done.append(f'first-step gradients {"agree" if grads.match else "differ"}')
    noisy, errors = tuple(leaf for leaf in report.leaves if leaf.noise_dominated), tuple(inputs.errors)
    if report.match:
        matched = Verdict(True, config.verdict, tuple(done), twin=twin_text, noise_dominated=noisy, errors=errors)
        return locate.attach(matched, kind, config, inputs, n_twin)  # only when --locate asks
    if not inputs.diagnose:  # only its match is read: no gradients probed, no re-run, not located
        return Verdict(False, config.verdict, tuple(done), twin=twin_text, noise_dominated=noisy, errors=errors)
    rerun = None
    # Only a first *loss* that differs can be re-checked with dropout off (the re-run compares
    # losses): a slip seen only in the first gradients is math, whatever dropout does.
    loss_failed = any(leaf.name == 'first_step/loss' for leaf in rule.failed(report, 'first_step'))
    if loss_failed and setups.uses_dropout(port) and cannot:
        done.append(f'deterministic re-run (dropout off) not run: {cannot}')
    elif loss_failed and setups.uses_dropout(port):
        rerun = deterministic_rerun_matches(kind, config, inputs, report)
        done.append(f'deterministic re-run (dropout off) {"matches" if rerun else "differs"}')
    nonfinite = rule.nonfinite_line(
        {'legacy': old.losses, 'nnx': new.losses},
        {'legacy': old.final, 'nnx': new.final},
        data_nonfinite(inputs.whole_calls(port, config)),
    )
    no_floor = twin_text if report.floor is None else ''
    diagnosed, line = rule.diagnose(report, nonfinite, rerun, grads is not None, no_floor)
    mismatch = Verdict(False, config.verdict, tuple(done), diagnosed, line, twin_text, noisy, errors)
    return locate.attach(mismatch, kind, config, inputs, n_twin)


def first_step_grads(kind: Kind, config: RunConfig, inputs: Inputs, n_twin) -> compare.Report:
    """The first step's gradients of both sides, held to the floor of the twin's (0 without one; none
    where the twin ran in a fresh process, ``locate.here``): the gradients each optimizer was given in
    the first steps that also locate a MISMATCH (``locate``)."""
    grads = locate.first_step_grads(kind, config, inputs, n_twin)
    ref, other, floor = (rule.first_step_tree(grads=grads[s]) for s in ('legacy', 'nnx', 'twin'))
    return compare.compare_to_floor(ref, other, floor, MEASURED_FLOOR)


def deterministic_rerun_matches(kind: Kind, config: RunConfig, inputs: Inputs, report: compare.Report) -> bool:
    """The first call again, both sides, every bridged Dropout off: do the first losses now agree?

    A user's own jitted step (a loop port) keeps its traces across calls, and the bridge acts
    only while tracing: ``dropout_off`` keys the traces it makes apart from the bridged ones
    (``randomness``), so the re-run traces again and no later run reuses a trace without dropout,
    with no cache cleared."""
    one = dataclasses.replace(config, calls=1)
    with randomness.dropout_off():
        old = sides.run_legacy(kind, one, inputs.variables, inputs.calls[:1], inputs.rng)
        new = sides.run_nnx(kind, one, inputs.variables, inputs.calls[:1], inputs.rng)
    leaf = next((x for x in report.leaves if x.name == 'first_step/loss'), None)
    limit = leaf.limit if leaf is not None and leaf.limit is not None else 0.0
    allowed = max(limit, MEASURED_FLOOR.min_ulps * compare.spacing32(float(old.losses[0])))
    return bool(abs(float(old.losses[0]) - float(new.losses[0])) <= allowed)


def data_nonfinite(calls: list) -> int | None:
    """The first step (1-based) whose batch holds NaN or Inf, or None (every process sees every row)."""
    step = 0
    for batch_KxG in calls:
        leaves = [np.asarray(v) for v in jax.tree.leaves(batch_KxG)]
        for k in range(leaves[0].shape[0]):
            step += 1
            if any(np.issubdtype(v.dtype, np.floating) and not np.isfinite(v[k]).all() for v in leaves):
                return step
    return None


@dataclasses.dataclass
class RunResult:
    config: RunConfig
    legacy: PathResult
    nnx: PathResult
    report: compare.Report
    resumed_at: int = 0  # NNX resumed from a checkpoint of this step: losses and divergence cover the steps after it
    notes: list[str] = dataclasses.field(default_factory=list)  # lines the report prints under its header
    verdict: Any = None  # rule.Verdict: what was measured and, on MISMATCH, the diagnosis (judge)
    programs: tuple[str, str] = ('pmap(scan)', 'NNX sharded scan')  # how each side ran its K steps (header)

    @property
    def outcome(self) -> Outcome:
        """The check's outcome, as its verdict decided it (``rule.Verdict.outcome``)."""
        return self.verdict.outcome if self.verdict is not None else Outcome.of(self.report.match)

    def param_divergence(self) -> list[float]:
        """Max |nnx - legacy| over all parameters, after each call."""
        pairs = zip(self.legacy.params_per_call, self.nnx.params_per_call, strict=True)
        return [max(float(np.abs(a[k] - b[k]).max()) for k in a) for a, b in pairs]


def judged(
    kind: Kind,
    config: RunConfig,
    old: PathResult,
    new: PathResult,
    variables,
    calls,
    rng,
    tree=None,
    diagnose: bool = True,
    **resumed,
) -> RunResult:
    """The two runs judged against their measured noise floor (``judge``);
    ``resumed``: ``restore`` and ``first_call`` of a run NNX resumed from a checkpoint; ``diagnose``:
    False where only the match is read (no diagnosis nor location on MISMATCH)."""
    inputs = Inputs(variables, calls, rng, diagnose=diagnose, **resumed)
    report, verdict = judge(kind, config, old, new, inputs, tree or sides.compared(kind, old, new)[0])
    return RunResult(config, old, new, report, verdict=verdict)
