"""The sensitivity of the verdict: the smallest ``--perturb`` it detects at D=8 on ``mlp``, on every
seed, and whether the unperturbed port MATCHes on all of them (issue 16, point 5).

``--perturb REL`` scales the NNX learning rate by ``1 + REL``: a slip of known size. The ladder
is walked down and stops at the first level missed on some seed.
"""

import dataclasses
import time
from collections.abc import Callable

from equivalence.core.compare.outcome import Outcome
from equivalence.corpus.entry import Entry
from equivalence.corpus.runner import LADDER, SENSITIVITY_DEVICES, Case, run_case


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    devices: int
    seeds: int
    baseline: list[Case]  # perturb 0, one per seed: a MISMATCH here is a false alarm (a wrong verdict)
    levels: dict[float, list[Case]]  # perturb -> one case per seed, down to the first level missed
    seconds: float

    @property
    def false_mismatches(self) -> list[Case]:
        return [c for c in self.baseline if c.outcome is not Outcome.MATCH]

    def detected(self, level: float) -> int:
        return sum(c.outcome is Outcome.MISMATCH for c in self.levels[level])

    @property
    def smallest(self) -> float | None:
        """The smallest level detected on every seed, every larger level detected too; None if none."""
        found = None
        for level, cases in self.levels.items():
            if self.detected(level) < len(cases):
                break
            found = level
        return found


def measure(seeds: int, progress: Callable[[Case], None] | None = None, **overrides) -> Sensitivity:
    """The baseline over ``seeds`` seeds, then each ladder level until one is missed on some seed."""
    from equivalence.corpus import builtin

    start, tick = time.perf_counter(), progress or (lambda case: None)

    def level(perturb: float) -> list[Case]:
        truth = {'truth': 'slip', 'kind': 'optimizer'} if perturb else {'truth': 'correct'}
        entry = Entry(f'mlp-perturb-{perturb:g}', port=builtin.MLP, what='', flags={'perturb': perturb}, **truth)
        cases = [run_case(entry, SENSITIVITY_DEVICES, seed, **overrides) for seed in range(seeds)]
        for case in cases:
            tick(case)
        return cases

    baseline, levels = level(0.0), {}
    for perturb in LADDER:
        levels[perturb] = level(perturb)
        if any(c.outcome is not Outcome.MISMATCH for c in levels[perturb]):
            break
    return Sensitivity(SENSITIVITY_DEVICES, seeds, baseline, levels, time.perf_counter() - start)
