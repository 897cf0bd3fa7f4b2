"""The report's first screen: the outcome, what differs, where, how sure, and what it cost, each in a line or
two of at most ``WIDTH`` characters. Every figure behind these lines is in ``--verbose`` (``render.text``) and the
JSON; this module shortens, it decides nothing.
"""

import textwrap

from equivalence.core.compare.findings import Finding, NoTwin, Twins
from equivalence.core.compare.outcome import Outcome
from equivalence.core.judge.judge import RunResult
from equivalence.core.measure import clock
from equivalence.core.report import words
from equivalence.core.run.nudge import Nudged
from equivalence.core.state.states import Uncompared

WIDTH = 100  # the first screen's lines, after the loss table
SHOWN = 3  # the leaves named under the verdict line

# A diagnosis in a few words: what kind of difference the leaves show.
DIAGNOSES = {
    Finding.MATH: 'the math: the first step already computes otherwise',
    Finding.RANDOMNESS: 'the randomness: with dropout off the first losses agree',
    Finding.OPTIMIZER: "the optimizer: the first step's loss and gradients agree, the state after does not",
    Finding.UPDATE: "the update: the first step's loss agrees, the state after training does not",
    Finding.STATE: 'running statistics: only the model state differs',
    Finding.EMA: 'the EMA: only the averaged parameters differ',
    Finding.METRICS: 'a reported metric: the training agrees, a metric the steps report does not',
    Finding.NON_FINITE: 'NaN or Inf: a side computed a value that is not finite',
    Finding.BOOKKEEPING: 'bookkeeping: leaves on one side only, nothing numeric differs',
    Finding.UNMEASURED: 'no floor was measured to tell noise from a slip',
}

# Where the first step parts, as a short cause, by the location's kind; {at} is its place on both sides.
PLACES = {
    'module': '{at} computes something else: its inputs agree, its output does not',
    'between': 'the code before {at}: the calls before agree, its input does not',
    'randomness': '{at} draws other random numbers',
    'loss': 'the loss: every module call compared agrees, the loss does not',
    'backward': 'the backward pass: the loss agrees, the gradients do not',
    'statistics': '{at} updates its running statistics otherwise',
    'update': '{at}: the gradients agree, the update does not',  # ``gradients``: 'not observed' says otherwise
    'ema': 'the EMA: the parameters agree, their average does not',
    'collective': "{at}: the pmap step's own collective",
    'none': 'nothing parts in the first steps recorded',
}


# What an update that parts implies, by what its size reads as (``implied``'s ``update``).
UPDATES = {
    'step factor': 'a learning rate, a schedule value (a warmup, a decay) or a gradient scale',
    'nesterov': 'Nesterov momentum on one side',
    'decay': 'a decoupled weight decay that differs',
    'masked decay': "a weight decay's mask that differs",
    'eps': "an adaptive optimizer's eps",
}


def lines(result: RunResult) -> list[str]:
    """From ``verdict:`` to the end of the first screen."""
    out = [*verdict(result), *diagnosis(result), *where(result), *sure(result), *cost(result)]
    out.append('more: --verbose prints every leaf, figure and stage; --json keeps them')
    return [wrapped for line in out for wrapped in fit(line)]


def verdict(result: RunResult) -> list[str]:
    """The outcome, and the leaves (at most ``SHOWN``) that give it."""
    report, outcome = result.report, result.outcome
    n, bad = len(report.leaves), [leaf for leaf in report.leaves if not leaf.ok]
    noisy = [leaf for leaf in report.leaves if leaf.noise_dominated]
    if outcome is Outcome.MATCH:
        within = 'within their floors' if report.floor is not None else 'within the fixed tolerance'
        also = f', {len(noisy)} noise-dominated' if noisy else ''
        return [f'verdict: MATCH: all {n} leaves {within}{also}']
    if outcome is Outcome.NOT_VERIFIED:
        return [f'verdict: NOT VERIFIED: {len(bad)} of {n} leaves apart, {len(noisy)} noise-dominated',
                f'  why: {words.unverified(result.verdict.unverified)}']  # fmt: skip
    ratio = lambda x: x.max_abs / x.limit if x.limit else x.max_abs  # noqa: E731
    ranked = sorted(bad, key=lambda x: (x.group != 'params', x.group == 'first_step', -ratio(x)))  # as --verbose
    shown = [f'  {leaf.name}: {leaf.max_abs:.2e} apart, {allowed(leaf)}' for leaf in ranked[:SHOWN]]
    more = [f'  and {len(bad) - SHOWN} more'] if len(bad) > SHOWN else []
    return [f'verdict: MISMATCH: {len(bad)} of {n} leaves apart beyond their floors', *shown, *more]


def allowed(leaf) -> str:
    part = f' ({leaf.bad:,} of {leaf.size:,} elements)' if leaf.size > 1 and leaf.bad else ''
    return (f'allowed {leaf.limit:.2e}' if leaf.limit is not None else 'outside the fixed tolerance') + part


def diagnosis(result: RunResult) -> list[str]:
    v = result.verdict
    if v is None or v.diagnosis is None:
        return []
    return [f'diagnosis: {DIAGNOSES.get(v.diagnosis.kind, str(v.diagnosis.kind))}']


def where(result: RunResult) -> list[str]:
    """The place, its evidence and its likely cause; the note where the diagnosis disagrees."""
    v = result.verdict
    loc = None if v is None else v.location
    if loc is None:
        return []
    if loc.kind == 'unlocated':
        return [f'where: not located ({loc.why.value if loc.why is not None else "no evidence"})']
    at = loc.legacy if loc.legacy == loc.new or not loc.new else f'{loc.legacy} ↔ {loc.new}'
    said = PLACES.get(str(loc.kind), '{at}').format(at=at)
    reading = loc.reading
    if reading.get('gradients') == 'not observed':  # the port's own step: its gradients are not at hand
        said = f"{at} parts (the gradients are not observed: the port's own step)"
    if loc.kind == 'between' and reading.get('inside') is not None:  # its inputs and submodules agree
        said = f'the code inside {reading["inside"]}: its inputs and its submodule calls agree, its output does not'
    elif loc.kind == 'between' and reading.get('before') is not None:  # the order of the calls, no data flow
        said = (f'the code between {reading["before"]} and the call after it, {reading["call"]}: every call before '
                'agrees, its input does not')  # fmt: skip
    elif loc.kind == 'between' and reading.get('call') is not None:
        said = f"the code before {reading['call']}, the first call, from the step's inputs: its input differs"
    elif loc.kind == 'randomness' and reading.get('draws') is not None:  # the step's own draws, not a module's
        said = f"the step's own random draws: {reading['differ']} of the pmap step's {reading['draws']} differ"
    elif loc.kind == 'loss' and reading.get('output_apart') is not None:
        said = "the loss: the model's output agrees, the loss does not"
    settings = ', '.join(f'{name} {a} ↔ {b}' for name, a, b in loc.settings[:2])
    if reading.get('parts') == 'loss term':
        said = f'the loss term {", ".join(reading["terms"])}: it parts, the other terms agree (its weight?)'
    elif 'clipping' in loc.legacy:
        said = f'{loc.legacy}: {loc.figures.split(";")[0]}'
    elif settings:
        said += f'; settings differ: {settings}'
    elif reading.get('update_factor') is not None:
        cause = UPDATES.get(reading.get('update'))
        said += f'; it steps {reading["update_factor"]:.6g}x the pmap side' + (f': {cause}' if cause else '')
    elif reading.get('update') == 'gradient scale':  # the moments show the gradients: they differ, by one factor
        factor = f'{reading["gradient_factor"]:.3g}'
        said = (f'{at}: the first moments part by {factor}: every gradient scaled by {factor} (a clip by global '
                'norm, a loss scale or reduction)')  # fmt: skip
    elif reading.get('update') in UPDATES:
        said += f': {UPDATES[reading["update"]]}'
    elif reading.get('by') in ('update', 'parameter') and reading.get('r2') is not None:
        cause = 'a learning rate or schedule' if reading['by'] == 'update' else 'a weight decay or its mask'
        said += f'; each call the difference grows with the {reading["by"]} (r² {reading["r2"]:.2f}): {cause}'
    elif reading.get('apart') is not None and reading.get('allowed') is not None:
        said += f' ({reading["apart"]:.1e} apart, allowed {reading["allowed"]:.1e})'
    if 'exact' in reading and reading.get('step', 1) > 1:  # a later step: the first moved nothing (a warmup) or agreed
        zero = "; step 1's update is 0, as warmup gives" if reading.get('first_update_zero') else ''
        before = 'nothing parts before it' if reading['exact'] else 'nothing parted on steps 1 and 2'
        said = f'on step {reading["step"]} ({before}{zero}): {said}'
    note = ['  note: the diagnosis and where: disagree; trust where:'] if words.disagree(v) else []
    return [f'where: {said}', *note]


def sure(result: RunResult) -> list[str]:
    """How sure: what the floor is, and on MATCH what it could have missed."""
    v = result.verdict
    if v is None:
        return []
    if isinstance(v.twin, Twins):
        floor = f'every leaf held to a floor measured by {twins(v.twin)}'
    elif isinstance(v.twin, NoTwin):
        floor = f'no floor measured ({words.twin(v.twin)})'
    else:
        floor = 'the fixed tolerance'
    s = v.sensitivity
    if v.match and s is not None and s.learning_rate is not None:
        return [f'how sure: {floor}', f'  it would catch a learning rate off by {s.learning_rate:.1e} of itself']
    return [f'how sure: {floor}']


def twins(record: Twins) -> str:
    """The twins that measured the floor, in a few words."""
    kinds = list(record.kinds)
    if all(isinstance(k, Nudged) for k in kinds):
        said = f'{len(kinds)} twin{"s" if len(kinds) > 1 else ""} of its own program (inputs one spacing off)'
    elif all(isinstance(k, int) for k in kinds):
        said = f'twins on {" and ".join(map(str, kinds))} device(s)'
    else:
        said = f"{len(kinds)} twin{'s' if len(kinds) > 1 else ''} on the run's devices, the batch's rows reordered"
    return said + (f', in each of {record.processes} processes' if record.processes > 1 else '')


def cost(result: RunResult) -> list[str]:
    if not result.timing:
        return []
    spent = clock.costs(result.timing)
    memory = result.timing.get('memory') or {}
    host = f'; host peak {memory["host_peak_bytes"] / 1e9:.2f} GB' if memory.get('host_peak_bytes') else ''
    devices = memory.get('device_peak_bytes') or {}
    device = f', device peak {max(devices.values()) / 1e9:.2f} GB' if devices else ''
    return [f'time: {result.timing["wall_s"]:.1f} s' + (f' ({spent})' if spent else '') + host + device]


def notes(result: RunResult) -> list[str]:
    """The notes under the header; the ``not compared`` lines counted in one (``--verbose`` lists each)."""
    uncompared = [n for n in result.notes if isinstance(n, Uncompared)]
    kept = [n for n in result.notes if not isinstance(n, Uncompared)]
    if len(uncompared) <= SHOWN:
        return [*uncompared, *kept]
    subjects = sorted({n.skip.value for n in uncompared})
    return [f'not compared: {len(uncompared)} fields and metrics ({", ".join(subjects)}; --verbose lists them)', *kept]


def fit(line: str) -> list[str]:
    """``line`` in lines of at most ``WIDTH`` characters, the rest indented under it."""
    indent = ' ' * (len(line) - len(line.lstrip()) + 2)
    return textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_on_hyphens=False) or ['']
