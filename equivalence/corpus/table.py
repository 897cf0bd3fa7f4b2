"""What ``python -m equivalence.corpus`` prints: the confusion matrix, one row per entry, the
sensitivity, and the count of wrong verdicts; and the same as JSON."""

import statistics

from equivalence.core.compare.outcome import Outcome
from equivalence.corpus.entry import Entry
from equivalence.corpus.runner import OUTCOMES, VERDICTS, Case, confusion, label
from equivalence.corpus.sensitivity import Sensitivity


def matrix(cases: list[Case]) -> list[str]:
    counts = confusion(cases)
    lines = ['confusion matrix (one case = one port, one device count, one seed)', '', f'{"":<16}{"verdict:":>9}']
    lines[-1] += ''.join(f'{v:>14}' for v in VERDICTS)
    for truth in ('correct', 'slip'):
        lines.append(f'{"truth " + truth:<25}' + ''.join(f'{counts[truth, v]:>14}' for v in VERDICTS))
    return lines


def entry_row(entry: Entry, cases: list[Case]) -> str:
    runs = [c for c in cases if c.entry == entry.name]
    if not runs:
        return f'{entry.name:<18} {entry.truth:<8} {entry.kind or "-":<10} not run (its device counts were not asked)'
    n = {label(o): sum(c.outcome is o for c in runs) for o in OUTCOMES}
    kinds = ','.join(sorted({c.kind for c in runs if c.kind})) or '-'
    wrong = [c for c in runs if c.wrong]
    seconds = [c.seconds for c in runs]
    first = f'  D={wrong[0].devices} seed {wrong[0].seed}: {wrong[0].detail}' if wrong else ''
    return (
        f'{entry.name:<18} {entry.truth:<8} {entry.kind or "-":<10} {len(runs):>4} {n["MATCH"]:>5} {n["MISMATCH"]:>8}'
        f' {n["NOT VERIFIED"]:>7} {n["ERROR"]:>5} {len(wrong):>5}  {kinds:<10} {statistics.median(seconds):>6.1f}'
        f' {sum(seconds):>7.0f}{first}'
    )


def entry_rows(entries: list[Entry], cases: list[Case]) -> list[str]:
    head = (
        f'{"entry":<18} {"truth":<8} {"expect":<10} {"runs":>4} {"MATCH":>5} {"MISMATCH":>8} {"UNVERIF":>7} '
        f'{"ERROR":>5} {"wrong":>5}  {"kinds":<10} {"med s":>6} {"total s":>7}  first wrong run'
    )
    return [head, *(entry_row(e, cases) for e in entries)]


def sensitivity_lines(s: Sensitivity) -> list[str]:
    smallest = 'none of the ladder' if s.smallest is None else f'{s.smallest:g}'
    lines = [
        f'sensitivity (mlp, D={s.devices}, {s.seeds} seed(s), {s.seconds:.0f} s): smallest --perturb detected on '
        f'every seed: {smallest}; --perturb 0: {len(s.false_mismatches)} false MISMATCH of {len(s.baseline)}'
    ]
    levels = ', '.join(f'{level:g}: {s.detected(level)}/{len(cases)}' for level, cases in s.levels.items())
    return [*lines, f'  detected per level: {levels}']


def wrong_cases(cases: list[Case], s: Sensitivity | None) -> list[Case]:
    """The corpus's wrong verdicts, and the sensitivity's false alarms (a missed level is not one)."""
    return [c for c in cases if c.wrong] + (s.false_mismatches if s is not None else [])


def summary(cases: list[Case], s: Sensitivity | None) -> str:
    wrong = wrong_cases(cases, s)
    by = {
        'correct -> MISMATCH': sum(c.truth == 'correct' and c.outcome is Outcome.MISMATCH for c in wrong),
        'slip -> MATCH': sum(c.outcome is Outcome.MATCH for c in wrong),
        'slip -> wrong kind': sum(c.wrong_kind for c in wrong),
        'NOT VERIFIED': sum(c.outcome is Outcome.NOT_VERIFIED for c in wrong),
        'ERROR': sum(c.outcome is None for c in wrong),
    }
    named = sum(c.kind is not None for c in cases if c.outcome is Outcome.MISMATCH)
    total = len(cases) + (len(s.baseline) if s is not None else 0)
    parts = ', '.join(f'{k} {v}' for k, v in by.items())
    return f'{len(wrong)} wrong verdicts of {total} runs ({parts}); diagnosis kind named on {named} MISMATCH runs'


def text(entries: list[Entry], cases: list[Case], s: Sensitivity | None, backend: str) -> str:
    lines = [f'verdict corpus on {backend}: {len(entries)} entries, {len(cases)} runs', '', *matrix(cases), '']
    lines += [*entry_rows(entries, cases), '']
    lines += [*sensitivity_lines(s), ''] if s is not None else []
    return '\n'.join([*lines, summary(cases, s)])


def to_json(cases: list[Case], s: Sensitivity | None) -> dict:
    from equivalence.core.report.render import versions

    out = {
        'wrong': len(wrong_cases(cases, s)),
        'confusion': {f'{t}/{v}': n for (t, v), n in confusion(cases).items()},
        'cases': [c.to_json() for c in cases],
        'versions': versions(),
    }
    if s is not None:
        out['sensitivity'] = {
            'devices': s.devices,
            'seeds': s.seeds,
            'smallest_detected': s.smallest,
            'false_mismatches': len(s.false_mismatches),
            'detected': {f'{level:g}': s.detected(level) for level in s.levels},
            'seconds': round(s.seconds, 1),
            'cases': [c.to_json() for c in [*s.baseline, *(c for v in s.levels.values() for c in v)]],
        }
    return out
