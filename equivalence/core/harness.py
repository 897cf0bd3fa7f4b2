"""The orchestration of one check, the only one: the port's kind (``kinds.of``), its pre-flight, the
inputs made once (``prepare``), both sides run from the same seed and data, the new side resumed from a
checkpoint where asked (``Checkpoints``), and the verdict (``judgement``). ``run``, ``run --resume-at``,
the corpus, the pytest plugin, ``explain`` and ``bench`` all go through it. It sits above every room of
``core``; nothing in ``core`` imports it.
"""

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax

from equivalence.core import kinds, preflight
from equivalence.core.compare.outcome import Outcome
from equivalence.core.judge import hints
from equivalence.core.judge.judge import RunResult, judged
from equivalence.core.judge.runs import Runs
from equivalence.core.measure import clock, precision
from equivalence.core.port import port_fields
from equivalence.core.port.config import ConfigError, RunConfig
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Plan, Run
from equivalence.core.port.ports import Port
from equivalence.core.reference import reference, referenced
from equivalence.core.rng import randomness
from equivalence.core.run import fits, freshness
from equivalence.core.run import inputs as made
from equivalence.core.run.facts import has_batch_stats, name_mapping
from equivalence.core.run.inputs import Inputs
from equivalence.core.run.sides import PathResult, Progress, both_sides, run_legacy, run_new, silent


def validate(port: Port, config: RunConfig, recording: bool = False) -> None:
    """What a port cannot do with these flags, as ``ConfigError`` (exit 2), before any work; ``recording``: for
    ``record``, which runs the pmap side alone."""
    freshness.starting(port)  # what earlier checks kept goes where the port's code changed since
    recorded = port_fields.recorded_fields(port)
    if recorded and recording:
        raise ConfigError(f'port {port.name!r}: {recorded[0]}=RECORDED: record runs the pmap side, and this port has '
                          'no pmap code to run; record the port that holds it (its legacy_step, legacy_model, ...), '
                          'where that code imports and runs')  # fmt: skip
    if recorded and config.reference is None:
        how = 'check it with --reference FILE (python -m equivalence.record writes one where the pmap code runs)'
        raise ConfigError(f'port {port.name!r}: {recorded[0]}=RECORDED, its pmap side read from a reference: {how}')
    if config.rng_mode not in port.rng_modes:
        raise ConfigError(f'--rng {config.rng_mode}: port {port.name!r} supports {", ".join(port.rng_modes)}')
    kinds.of(port).validate(Plan.of(config).run)
    if config.strategy == 'shard_map' and has_batch_stats(port):
        raise ConfigError('--strategy shard_map: the model has BatchNorm, whose statistics would be per device here')


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A port ready to run: its kind, the plan resolved from its validated config, and the inputs made once."""

    kind: Kind
    plan: Plan
    inputs: Inputs

    @property
    def run(self) -> Run:
        return self.plan.run


def prepare(port: Port, config: RunConfig, n_steps: int | None = None) -> Prepared:
    """The port traced abstractly (``preflight``: a mistake in it is exit 2, before training; it pairs the
    two sides' names, once), then its inputs made. ``config`` must have passed ``validate``. ``n_steps``:
    the steps the pre-flight asks ``make_data`` for (bench's pool)."""
    return _prepare(port, Plan.of(config), n_steps)


def _prepare(port: Port, plan: Plan, n_steps: int | None = None) -> Prepared:
    freshness.starting(port)  # what earlier checks kept goes where the port's code changed since
    kind, run = kinds.of(port), plan.run
    if plan.reference is not None:
        return _from_reference(kind, plan)
    with clock.stage("initial variables: linen's initialisation traced, compiled on a thread"):
        started, compiling, shapes = _init_aside(port, run)
    with clock.stage('pre-flight (the port traced abstractly)'):
        try:
            mapping = preflight.check(kind, run, n_steps, shapes)
        except Exception:
            if compiling is not None:
                compiling.result()  # no compile left running while the port's mistake is said
            raise
    randomness.take_unbridged()  # what earlier runs traced is theirs
    if shapes is not None:  # both train states on one device: refused before the inputs are made (GPT-2 large's
        try:  # initial variables took 70 s on a TPU chip before the refusal)
            fits.check(kind, run, shapes)
        except ConfigError:
            compiling.result()  # the linen initialisation's compile (seconds) ends before the refusal is said
            raise
    with clock.stage('inputs (data, keys, initial variables)'):
        if compiling is not None:
            compiling.result()
        inputs = made.make(port, run, mapping, started)
    if shapes is None:
        fits.check(kind, run, inputs.variables)
    return Prepared(kind, plan, inputs)


def _from_reference(kind: Kind, plan: Plan) -> Prepared:
    """A port whose pmap side is read from ``plan.reference`` (``reference.referenced``): its inputs are the
    recorded ones, its names paired with the new side's (``naming.PortError``, exit 2, where they do not pair),
    nothing of the pmap code run or imported. A reference that does not fit is exit 2 before any training."""
    with clock.stage(f'reference {plan.reference} read, every array checked against its sha256'):
        held, recorded = referenced.read(plan.reference, kind, plan.run)
        mapping = name_mapping(kind.port, held['variables'])
    with clock.stage('pre-flight (the new side traced abstractly)'):
        preflight.check_new(kind, plan.run, held['variables'], held['calls'][0], mapping)
    recorded = dataclasses.replace(recorded.named(mapping), gone=port_fields.recorded_fields(kind.port))
    inputs = Inputs(held['variables'], held['calls'], held['rng'], mapping, recorded=recorded)
    return Prepared(kind, plan, inputs)


def record(port: Port, config: RunConfig, path: str, say: clock.Say | None = None) -> dict:
    """The pmap side of a check recorded at ``path`` (``python -m equivalence.record``): the inputs made as a
    check makes them, the legacy run and its first steps recorded (``referenced.record``); the new side is
    neither run nor paired. ``{'timing': ...}``: what each stage cost."""
    if jax.process_count() > 1:
        raise ConfigError('a reference is recorded in one process: its pmap side spans the devices this process sees')
    freshness.starting(port)
    kind, run = kinds.of(port), Plan.of(config).run
    with clock.measuring(say) as measured:
        with clock.stage('pre-flight (the pmap side traced abstractly)'):
            preflight.check_legacy(kind, run)  # its mistakes are exit 2 here, as run's are, before training
        if fits.limit() is not None:  # a device that says its bytes: refused before the inputs are made
            fits.check(kind, run, made.start(port, run).shapes(), sides=1, legacy=True)
        with precision.computing_at(run.precision):
            with clock.stage('inputs (data, keys, initial variables)'):
                inputs = made.unpaired(port, run)
            with clock.stage(f'legacy side: {kind.programs()[0]}, {len(inputs.calls)} calls, then its first steps '
                             'recorded module by module'):  # fmt: skip
                tree = referenced.record(kind, run, inputs)
            reference.save(path, run, port.name, tree)
    return {'timing': measured.summary(), 'losses': tree['legacy'].losses}


def _init_aside(port: Port, config: Run) -> tuple:
    """``(made.start's, its linen initialisation compiling on a thread, linen's variables as shapes)`` while the
    pre-flight runs, which reads those shapes rather than tracing the initialisation again; ``(None, None, None)``
    where the port cannot start so (the pre-flight then says why, and the inputs start afresh)."""
    try:
        started = made.start(port, config)
        lowered = started.lowered()
        shapes = started.shapes()
    except Exception:  # noqa: BLE001 -- the pre-flight says the port's mistake, in its words
        return None, None, None
    return started, clock.on_thread(lowered.compile), shapes


@dataclasses.dataclass(frozen=True)
class Resume:
    """The new side resumed from a checkpoint of the legacy run (``Checkpoints.resume``)."""

    step: int  # the step it resumes from: it trains the calls after it
    config: Run  # its run (its device count may be another)
    restore: Callable[[Any], jax.Array]  # loads the checkpoint into a setup, returns the key chain
    notes: tuple[str, ...] = ()


class Checkpoints(Protocol):
    """How ``run --resume-at`` and ``--checkpoint-dir`` enter the pipeline (``equivalence.checkpoint.resume``):
    a session (its directories live while the check runs, the twins restore from them too), a hook after
    each legacy call, and the resume of the new side, if any."""

    def session(self, prepared: Prepared) -> contextlib.AbstractContextManager['CheckpointSession']: ...


class CheckpointSession(Protocol):
    notes: list[str]

    def after_legacy_call(self, setup: Any, calls_done: int, rng: jax.Array) -> None: ...
    def resume(self, prepared: Prepared, legacy: PathResult) -> Resume | None: ...


def run(port: Port, config: RunConfig, progress: Progress | None = None, diagnose: bool = True,
        checkpoints: Checkpoints | None = None, say: clock.Say | None = None) -> RunResult:  # fmt: skip
    """Both paths, then the comparison of parameters, optimizer state, EMA, stats, losses, judged.

    ``config`` has passed ``validate`` (the commands validate before any work; ``check`` does it here).
    The two sides' variable names are paired by the pre-flight, before any training (``naming.PortError``).
    ``progress``, if given, is called after each of the 2 * C compiled calls. ``diagnose=False``: a MISMATCH
    is neither diagnosed nor located (a run whose match alone is read, as the masked-loss hint's on 1
    device); its outcome is a diagnosed run's (no floor: NOT VERIFIED where nothing floor-free explains it).
    ``checkpoints``: legacy saves, and the new side resumed from one (``Checkpoints``). ``say``: told each
    stage as it begins and ends (``clock.Lines``); every stage is measured (``RunResult.timing``). The config is
    resolved once into a ``Plan``; each stage below is handed its part."""
    plan = Plan.of(config)
    again = _Again(port, config)  # the hint and the default-precision gap run the check again, whole
    with clock.measuring(say) as measured:
        with precision.computing_at(plan.run.precision):
            result = _run(port, plan, progress or silent, diagnose, checkpoints, again)
        result.config, result.device = config, precision.Device.here(plan.run.devices, plan.run.precision)
        at_highest = plan.run.precision == 'auto' and result.device.precision == 'highest'
        if plan.default_gap and diagnose and at_highest and not plan.reference:  # asked: both sides again
            result.device = dataclasses.replace(result.device, default_gap=again.default_gap() or {})
    result.timing = measured.summary()
    return result


@dataclasses.dataclass(frozen=True)
class _Again:
    """The check run again, from its whole config: on one device (the masked-loss hint), and at the backend's
    default precision (``--default-gap``)."""

    port: Port
    config: RunConfig

    def matches_on_one(self) -> bool:
        """Whether the same run matches on one device (data parallel, one process): the masked-loss hint's test."""
        if jax.process_count() != 1 or self.config.strategy != 'dp':
            return False
        try:
            with clock.stage('hint: the same run on 1 device'):
                on_one = dataclasses.replace(self.config, devices=1)
                return run(self.port, on_one, diagnose=False).outcome is Outcome.MATCH
        except ConfigError:
            return False

    def default_gap(self) -> dict | None:
        """How far apart the two sides end at the backend's default precision (``precision.gap``), run again
        bare: what the check at ``highest`` did not judge. None where they cannot run so (the verdict stands)."""
        default = dataclasses.replace(self.config, precision='default')
        try:
            with clock.stage("both sides again at the backend's default precision (said, not judged)"):
                prepared = prepare(self.port, default)
                old, new = both_sides(prepared.kind, prepared.run, prepared.inputs)
        except Exception:  # noqa: BLE001 -- a figure beside the verdict, never an error in place of it
            return None
        return precision.gap(old, new)


def _run(port: Port, plan: Plan, progress: Progress, diagnose: bool, checkpoints, again: _Again) -> RunResult:
    prepared = _prepare(port, plan)
    kind, run, inputs = prepared.kind, plan.run, prepared.inputs
    resumed = False
    if inputs.recorded is not None:
        return _against_reference(prepared, progress, diagnose)
    if checkpoints is None:
        old, new = both_sides(kind, run, inputs, progress)
        result = judgement(kind, plan, old, new, inputs, diagnose=diagnose)
    else:
        result, resumed = _with_checkpoints(prepared, progress, diagnose, checkpoints)
    if diagnose and not resumed:  # the hint runs both sides again on 1 device: part of a MISMATCH's diagnosis
        result.notes += hints.masked_loss(run.devices, inputs.calls, result.outcome, again.matches_on_one)
    return result


def _against_reference(prepared: Prepared, progress: Progress, diagnose: bool) -> RunResult:
    """The new side alone, judged against the pmap side a reference holds. Its random numbers are drawn as
    the recorded run drew them: JAX's threefry splits and draws other bits for the same key since jax 0.5
    (``jax_threefry_partitionable``), so the recorded setting is the check's, and said where it is not today's."""
    kind, plan, inputs = prepared.kind, prepared.plan, prepared.inputs
    recorded = inputs.recorded
    fits.check(kind, plan.run, inputs.variables, sides=1)
    partitionable = recorded.environment.get('threefry_partitionable', jax.config.jax_threefry_partitionable)
    with jax.threefry_partitionable(bool(partitionable)):
        with clock.stage(f'new side: {kind.programs()[1]}, {len(inputs.calls)} calls (compiled, run)'):
            new = run_new(kind, plan.run, inputs, progress)
        result = judgement(kind, plan, recorded.legacy, new, inputs, diagnose=diagnose)
    result.notes.append(f'the pmap side read from the reference {plan.reference}, recorded on '
                        f'{referenced.where_recorded(recorded.environment)}')  # fmt: skip
    if bool(partitionable) != bool(jax.config.jax_threefry_partitionable):
        result.notes.append(f'keys drawn as the reference drew them: jax_threefry_partitionable={bool(partitionable)} '
                            f'(this JAX draws other numbers from the same key by default)')  # fmt: skip
    return result


def _with_checkpoints(prepared: Prepared, progress: Progress, diagnose: bool, checkpoints) -> tuple[RunResult, bool]:
    """``(the result, whether the new side resumed)``: one side after the other, the legacy run saving after
    its calls, the new side resumed from one of them where asked."""
    kind, plan, inputs = prepared.kind, prepared.plan, prepared.inputs
    config, legacy_program, new_program = plan.run, *kind.programs()
    with checkpoints.session(prepared) as saving:
        with clock.stage(f'legacy side: {legacy_program}, {len(inputs.calls)} calls (compiled, run)'):
            old = run_legacy(kind, config, inputs, progress, saving.after_legacy_call)
        resume = saving.resume(prepared, old)
        if resume is None:
            with clock.stage(f'new side: {new_program}, {len(inputs.calls)} calls (compiled, run)'):
                new = run_new(kind, config, inputs, progress)
            result = judgement(kind, plan, old, new, inputs, diagnose=diagnose)
        else:
            resumed = resumed_inputs(inputs, resume, config.steps_per_call)
            with clock.stage(f'new side: {new_program}, resumed at step {resume.step} (compiled, run)'):
                new = run_new(kind, resume.config, resumed, progress)
            resumed_plan = dataclasses.replace(plan, run=resume.config)
            result = judgement(kind, resumed_plan, old, new, resumed, resume.step, diagnose)
        result.notes += [*saving.notes, *(resume.notes if resume else ())]
    return result, resume is not None


def resumed_inputs(inputs: Inputs, resume: Resume, k: int) -> Inputs:
    """What the new side is given when it resumes at ``resume.step``: the calls after it, no key chain
    (the checkpoint's restore gives it), and the restore, which its twin takes too."""
    first = resume.step // k
    whole = None if inputs.whole is None else inputs.whole[first:]
    return dataclasses.replace(inputs, calls=inputs.calls[first:], whole=whole, rng=None, restore=resume.restore,
                               first_call=first)  # fmt: skip


def judgement(kind: Kind, plan: Plan, old: PathResult, new: PathResult, inputs: Inputs, resumed_at: int = 0,
              diagnose: bool = True) -> RunResult:  # fmt: skip
    """The two runs compared and judged (``judge.judge``, handed the run and the judging parts of the plan); a
    new side resumed at ``resumed_at`` is compared with the legacy run's losses, metrics and parameters after
    that step. Its ``config`` is the plan's run until ``run`` gives it the whole config."""
    if resumed_at:
        old = old.after(resumed_at, plan.run.steps_per_call)
    runs = Runs(kind, plan.run, inputs)  # what the verdict asks to be run beyond the two runs
    with clock.stage('verdict'):
        report, verdict, notes = judged(kind, plan, old, new, inputs, runs, diagnose)
    result = RunResult(plan.run, old, new, report, notes=notes, verdict=verdict)
    result.programs, result.new_side, result.keys = kind.programs(), kind.new_side(), kind.keys(plan.run)
    result.resumed_at = resumed_at
    return result


def check(port: Port, diagnose: bool = True, **flags) -> RunResult:
    """Run both paths of ``port`` on this process's devices and compare them: the library form
    of ``python -m equivalence.run``. ``flags`` are ``RunConfig`` fields (``devices`` defaults
    to every device JAX sees, ``batch_size`` to the port's; with ``reference=FILE``, each to the value the
    reference was recorded with, and one given that differs is refused); bad values raise ``ConfigError``.
    ``diagnose=False``: a MISMATCH is the verdict and its leaves only, with no diagnosis, location or
    hint, each of which runs both sides' first steps again (about half a MISMATCH's time): for a
    test that expects a slip to fail."""
    if flags.get('reference') is not None:  # the run it holds: its D, K, C, batch, seed and keys, unless given
        flags = reference.with_recorded(flags)
    flags.setdefault('devices', len(jax.devices()))
    flags.setdefault('batch_size', port.default_batch)
    flags.setdefault('rng_mode', port.rng_modes[0])
    config = RunConfig(workload=port.name, available=len(jax.devices()), **flags)
    validate(port, config)
    return run(port, config, diagnose=diagnose)
