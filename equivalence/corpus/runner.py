"""The corpus run: every entry at every device count and seed, each run judged against its truth.

The verdict is the harness's own (``equivalence.check``): its outcome (``RunResult.outcome``), and
the diagnosis kind it names. A run that raises is an ERROR, and wrong.
"""

import dataclasses
import time
from collections.abc import Callable, Iterable

from equivalence.core.compare.outcome import Outcome
from equivalence.corpus.entry import Entry
from equivalence.devices import release_compiled_programs

OUTCOMES = (Outcome.MATCH, Outcome.MISMATCH, Outcome.NOT_VERIFIED, None)  # the tables' columns; None: an ERROR
LADDER = (1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6, 3e-7, 1e-7)  # --perturb levels, walked down to the first miss
SENSITIVITY_DEVICES = 8  # issue 16: the smallest --perturb detected at D=8 on mlp


# A slip's expected kind -> the verdict's kinds that name it. A loop port has no gradient probe,
# so its optimizer slip is diagnosed as 'update' (the update differs, the first loss agrees).
ACCEPTED = {
    None: set(),
    'math': {'math'},
    'randomness': {'randomness'},
    'state': {'state'},
    'ema': {'ema'},
    'optimizer': {'optimizer', 'update'},
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One run of one entry: its truth, the verdict it got, and how long it took."""

    entry: str
    truth: str  # 'correct' or 'slip'
    expected_kind: str | None  # slips: the diagnosis kind the verdict should name
    devices: int
    seed: int
    outcome: Outcome | None  # the check's outcome; None: the run raised (an ERROR)
    kind: str | None  # the diagnosis kind the verdict named; None: it named none
    seconds: float
    detail: str = ''  # the worst leaf, or the error
    # The margins (``margins``): how close the run came to the other verdict, in the verdict's own terms.
    ratio: float | None = None  # max |nnx - legacy| / floor over the leaves whose floor sets the limit
    ratio_leaf: str = ''
    x_limit: float | None = None  # max |nnx - legacy| / limit over every judged leaf (> 1: MISMATCH)
    x_limit_leaf: str = ''
    noisy: int = 0  # noise-dominated leaves (not judged)
    twin: str = ''  # where the twin ran, or why it did not (the verdict's own words)
    done: str = ''  # what the verdict measured, in its own words ('; '-joined): the legacy twin among them

    @property
    def verdict(self) -> str:
        """How the tables and the JSON name it: the outcome's label, or 'ERROR'."""
        return label(self.outcome)

    def to_json(self) -> dict:
        """Its fields, the outcome as its label under ``verdict``, and whether it is wrong."""
        fields = {('verdict' if k == 'outcome' else k): v for k, v in vars(self).items()}
        return {**fields, 'verdict': self.verdict, 'wrong': self.wrong}

    @property
    def wrong_kind(self) -> bool:
        return (
            self.outcome is Outcome.MISMATCH and self.kind is not None and self.kind not in ACCEPTED[self.expected_kind]
        )

    @property
    def wrong(self) -> bool:
        """A correct port that does not MATCH, a slip that does not MISMATCH or is misdiagnosed, or an
        error: NOT VERIFIED is never the right verdict on an entry whose truth is known."""
        if self.outcome in (None, Outcome.NOT_VERIFIED):
            return True
        if self.truth == 'correct':
            return self.outcome is Outcome.MISMATCH
        return self.outcome is Outcome.MATCH or self.wrong_kind


def diagnosis_kind(result) -> str | None:
    """The kind the verdict named (``result.verdict.kind``; also ``result.diagnosis`` or
    ``result.report.diagnosis``, a string or an object with ``.kind``); None when it names none."""
    kind = getattr(getattr(result, 'verdict', None), 'kind', None)
    if kind:
        return kind
    for holder in (result, result.report):
        diagnosis = getattr(holder, 'diagnosis', None)
        if diagnosis is not None:
            return diagnosis if isinstance(diagnosis, str) else getattr(diagnosis, 'kind', None)
    return None


def worst_leaf(report) -> str:
    leaf = report.worst(1)[0] if report.leaves else None
    return '' if leaf is None else f'{leaf.name}: {leaf.bad} of {leaf.size} off, max {leaf.max_abs:.2g}'


def margins(report) -> dict:
    """The worst ratio to the floor and to the limit, each with its leaf, over the leaves judged
    against a measured floor (noise-dominated, one-sided and non-finite leaves are not)."""
    rule = getattr(report, 'floor', None)
    judged = [
        leaf
        for leaf in report.leaves
        if leaf.floor is not None and leaf.limit and not leaf.noise_dominated and not leaf.note
    ]
    out = {'noisy': sum(leaf.noise_dominated for leaf in report.leaves)}
    if rule is None or not judged:
        return out
    by_floor = [leaf for leaf in judged if leaf.floor > 0 and leaf.limit <= rule.safety * leaf.floor]
    worst = max(judged, key=lambda leaf: leaf.max_abs / leaf.limit)
    out.update(x_limit=worst.max_abs / worst.limit, x_limit_leaf=worst.name)
    if by_floor:
        top = max(by_floor, key=lambda leaf: leaf.max_abs / leaf.floor)
        out.update(ratio=top.max_abs / top.floor, ratio_leaf=top.name)
    return out


def run_case(entry: Entry, devices: int, seed: int, **overrides) -> Case:
    """``equivalence.check`` of the entry's port; ``overrides``: RunConfig fields (tests shrink K and C)."""
    import equivalence
    from equivalence.core.report import words

    start = time.perf_counter()
    try:
        # the corpus judges the verdict and its kind, not the location: no locating run (RunConfig.locate)
        result = equivalence.check(
            entry.port, devices=devices, seed=seed, **{'locate': False, **entry.flags, **overrides}
        )
        outcome = result.outcome
        kind, detail = diagnosis_kind(result), worst_leaf(result.report)
        judged = getattr(result, 'verdict', None)
        said = {'twin': words.twin(judged.twin), 'done': '; '.join(words.done(judged))} if judged else {}
        extra = {**margins(result.report), **said}
    except Exception as e:  # noqa: BLE001 -- one broken run is a wrong verdict, not the end of the corpus
        outcome, kind, detail = None, None, f'{type(e).__name__}: {(str(e).splitlines() or [""])[0][:200]}'
        extra = {}
    seconds = time.perf_counter() - start
    release_compiled_programs()
    return Case(entry.name, entry.truth, entry.kind, devices, seed, outcome, kind, seconds, detail, **extra)


def run(
    entries: Iterable[Entry],
    devices: tuple[int, ...],
    seeds: int,
    progress: Callable[[Case], None] | None = None,
    **overrides,
) -> list[Case]:
    """Every entry at each of its device counts and seeds, in order."""
    cases = []
    for entry in entries:
        for d in entry.device_counts(devices):
            for seed in entry.seeds(seeds):
                cases.append(run_case(entry, d, seed, **overrides))
                if progress is not None:
                    progress(cases[-1])
    return cases


def label(outcome: Outcome | None) -> str:
    """'MATCH', 'MISMATCH', 'NOT VERIFIED', or 'ERROR' (None: the run raised)."""
    return 'ERROR' if outcome is None else outcome.label


VERDICTS = tuple(label(o) for o in OUTCOMES)


def confusion(cases: list[Case]) -> dict[tuple[str, str], int]:
    """``{(truth, verdict): runs}`` for every truth and verdict (its label), zeros included."""
    truths = ('correct', 'slip')
    return {(t, label(o)): sum(c.truth == t and c.outcome is o for c in cases) for t in truths for o in OUTCOMES}
