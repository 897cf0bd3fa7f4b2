"""What every pitfall case shares: its result type, the damage threshold, small helpers.

A case module exposes ``NUMBER`` (its place in the table), ``NAME`` (its module name),
``TITLE``, ``DESCRIPTION`` (the trap, and when it bites) and ``run(devices) -> CaseResult``.
"""

import dataclasses
from typing import Any

import numpy as np

from equivalence.core.compare import compare
from equivalence.core.compare.outcome import Outcome

TOL = compare.FLOAT32_REDUCTION_ORDER  # "the fix matches": the suite's own tolerance, reason included
# "the wrong version shows damage": a difference 100x the tolerance's absolute floor, so it
# cannot be float32 rounding (observed rounding in this suite: about 2e-7).
DAMAGE = 100 * TOL.atol


@dataclasses.dataclass(frozen=True)
class CaseResult:
    symptom: str  # what the wrong version did, measured: a number with its meaning, or an error's first line
    threshold: str  # what counts as damage, stated before looking
    damage_shown: bool  # the wrong version crossed the threshold (or raised the error)
    fix: str  # what the fixed version measured
    fix_matches: bool  # the fixed version matches the reference within TOL (or runs where the wrong one fails)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)  # the figures behind both lines, JSON-able
    damage_required: bool = True  # False only where the damage is a hazard that cannot be forced (see case 9)
    # The wrong version was measured to change nothing (case 6: the same program, bitwise the same results):
    # no damage of its own, damage_shown False; the trap is what it fails to do, which the symptom says.
    changes_nothing: bool = False

    @property
    def documented(self) -> bool:
        """The case behaves as its description says: damage shown (where it can be forced), or measured to
        change nothing where that is the trap, and the fix matches."""
        return self.fix_matches and (self.damage_shown or self.changes_nothing or not self.damage_required)


def first_line(error: BaseException) -> str:
    """An exception as a user sees it first: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f'{type(error).__name__}: {lines[0] if lines else ""}'


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Max |a - b| over the leaves of two flat trees with the same paths."""
    if set(a) != set(b):
        raise ValueError(f'paths differ: {sorted(set(a) ^ set(b))}')
    return max(float(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)).max()) for k in a)


def within_tol(ref: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> bool:
    """Every leaf within TOL, as the suite's fixed screen compares (``compare.compare``: a leaf on one side only
    does not match), read from its outcome."""
    as_array = lambda tree: {k: np.asarray(v) for k, v in tree.items()}  # noqa: E731
    return compare.compare({'x': as_array(ref)}, {'x': as_array(other)}, TOL).outcome is Outcome.MATCH


def matched(result) -> bool:
    """A check's outcome (``harness.run``'s ``RunResult.outcome``, decided by its verdict) is MATCH."""
    return result.outcome is Outcome.MATCH


def indivisible(devices: int, start: int = 100) -> int:
    """The original question's global batch of 100, or the next size that ``devices`` does not divide."""
    return next(g for g in range(start, start + devices) if g % devices)


def padded(batch: int, devices: int) -> int:
    """``batch`` rounded up to a multiple of ``devices``."""
    return -(-batch // devices) * devices


def yes(flag: bool) -> str:
    return 'yes' if flag else 'no'
