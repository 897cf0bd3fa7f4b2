"""A difference below one step's floor that keeps its shape over the calls (issue 61): the evidence a floor
cannot give, read from what the check already holds, the parameters after every call.

Each call's change in the difference ``new - legacy`` is regressed, leaf by leaf, through the origin, on
what a slip in the update makes it proportional to: the **parameter** itself (a decoupled weight decay, an
L2 term under SGD, a weight-decay mask: each step subtracts ``a * p`` more on one side) and the **update**
(a learning rate or a schedule value: each step moves ``(1 + e)`` times as far). Rounding is uncorrelated with
both: a leaf's ``r²`` over ``N`` values is then ``Beta(1/2, (N - 1)/2)``, and ``chance`` bounds the odds of
reaching it. The twins' own changes (``twin - new``, the run's own program from inputs one spacing off) are read
the same way: a structure they share is the port's own dynamics, not a slip.

Measured (docs/below-the-floor.md; K = C = 2): 80 correct runs (mlp, wide, score,
cnn at D = 1, 2, 4, 8 and two seeds; the corpus's correct ports at D = 1, 2, 8; the eight examples at D = 1, 2, 4),
every leaf of at least 16 values that is not noise-dominated, each of its twins' r² under half its own: no trend
decisive or suggestive (the largest r² 0.71, on 16 values, its twin's 0.47). Of 34 slip runs, the 17 in the update
are decisive: a weight decay 2x and 0 (r² 0.993, 1.000), masked to the kernels on the 1-D leaves (0.992; under a
warmup, 0.53 over 4 steps, thin, and 0.78 over 16, decisive), a learning rate 1 + 1e-5 and 1 + 1e-6 (0.989 to
0.999, on the update); the other 17 (the forward pass, the randomness, the statistics, Adam's eps and b2, which
their floors catch) show none.
"""

import dataclasses
import math

import numpy as np

from equivalence.core.compare import compare
from equivalence.core.compare.compare import LeafDiff
from equivalence.core.compare.location import Location, Unplaced, Where
from equivalence.core.compare.location import read as located

BY = ('parameter', 'update')  # what a leaf's change in the difference is regressed on
MIN_VALUES = 16  # fewer values (elements x calls) say nothing: a bias of 1 element fits any line
DECISIVE_R2, DECISIVE_CHANCE = 0.75, 1e-9  # a MISMATCH: the structure, past what rounding gives by chance
SUGGESTIVE_R2, SUGGESTIVE_CHANCE = 0.4, 1e-6  # not decided: NOT VERIFIED, naming the steps that would decide
TWIN_SHARE = 0.5  # the twins' own r² on the leaf must stay under this share of the run's
MIN_SPACINGS = 2.0  # some element of the leaf ends this many float32 spacings apart: no quantisation artefact


@dataclasses.dataclass(frozen=True)
class Trend:
    """One leaf whose difference grows in proportion to ``by`` (``BY``)."""

    leaf: str  # the parameter's path (NNX's)
    by: str  # 'parameter' or 'update'
    r2: float
    chance: float  # the odds of an r² this high from rounding alone, over ``values``
    values: int  # elements x calls
    factor: float  # per step: the change in the difference per step, over the regressor (``-a``, or ``e``)
    twin_r2: float  # the twins' own, on this leaf
    spacings: float  # the largest end difference, in float32 spacings of the leaf's largest value
    apart: float  # the largest end difference
    ndim: int

    @property
    def decisive(self) -> bool:
        return self.r2 >= DECISIVE_R2 and self.chance <= DECISIVE_CHANCE


@dataclasses.dataclass(frozen=True)
class Reading:
    """What the calls' parameters show beyond the floors: the decisive trends, and those that only suggest one."""

    decisive: tuple[Trend, ...] = ()
    suggestive: tuple[Trend, ...] = ()
    steps: int = 0  # the steps read (K x C)

    def steps_to_decide(self) -> int:
        """Steps after which the suggestive trends would be decisive, their difference growing linearly and the
        rounding not (``r²`` of ``N`` values rises as the signal's share of the variance): 4x, at least."""
        return 4 * self.steps


def chance(r2: float, n: int) -> float:
    """``P(R² >= r2)`` for ``R² ~ Beta(1/2, m)``, ``m = (n - 1)/2``, by its upper tail ``(1 - r2)^m / sqrt(pi m)``."""
    m = (n - 1) / 2
    if m <= 0 or r2 <= 0:
        return 1.0
    return min(1.0, (1.0 - min(r2, 1.0)) ** m / math.sqrt(math.pi * m))


def _fit(xs: list[np.ndarray], ys: list[np.ndarray]) -> tuple[float, list[float]]:
    """``(r² of all the values through the origin, the slope of each call)``."""
    x, y = np.concatenate(xs), np.concatenate(ys)
    den = float(np.dot(x, x) * np.dot(y, y))
    r2 = float(np.dot(x, y) ** 2 / den) if den > 0 else 0.0
    slopes = [float(np.dot(a, b) / np.dot(a, a)) if np.dot(a, a) > 0 else 0.0 for a, b in zip(xs, ys, strict=True)]
    return r2, slopes


def _changes(ref: list, other: list, ref_start: np.ndarray, other_start: np.ndarray, path: str) -> dict:
    """``{'parameter': (xs, ys), 'update': (xs, ys)}``: each call's change in ``other - ref`` (``ys``), and the
    parameter before the call and its update over it, on ``ref``'s side (``xs``)."""
    wide = lambda a: np.asarray(a, np.float64).ravel()  # noqa: E731
    before, apart = wide(ref_start), wide(other_start) - wide(ref_start)
    out = {by: ([], []) for by in BY}
    for a, b in zip(ref, other, strict=True):
        now = wide(b[path]) - wide(a[path])
        for by, x in (('parameter', before), ('update', wide(a[path]) - before)):
            out[by][0].append(x)
            out[by][1].append(now - apart)
        before, apart = wide(a[path]), now
    return out


def read(legacy: list, new: list, start: dict, twins: list[tuple[list, dict]], noisy: frozenset, k: int) -> Reading:
    """The trends of every parameter leaf (``legacy``, ``new``: the parameters after each call, by NNX path;
    ``start``: both sides' initial parameters; ``twins``: each twin's parameters after each call and its own
    start), leaving out the ``noisy`` ones (noise-dominated: their difference is the run's chaos)."""
    if not legacy or not new or len(legacy) != len(new):
        return Reading()
    decisive, suggestive = [], []
    for path, last in legacy[-1].items():
        a0 = start.get(path)
        if path in noisy or a0 is None or path not in new[-1] or not compare.is_float(np.asarray(last).dtype):
            continue
        n = int(np.size(last)) * len(legacy)
        if n < MIN_VALUES or np.shape(new[-1][path]) != np.shape(last):
            continue
        ends = np.abs(np.asarray(new[-1][path], np.float64) - np.asarray(last, np.float64))
        spacings = float(ends.max(initial=0.0)) / compare.spacing32(float(np.abs(last).max(initial=0.0)) or 1.0)
        if spacings < MIN_SPACINGS:
            continue
        run = _changes(legacy, new, a0, a0, path)
        own = [_changes(new, calls, a0, tw_start.get(path, a0), path) for calls, tw_start in twins if path in calls[-1]]
        for by in BY:
            r2, slopes = _fit(*run[by])
            same_sign = all(s > 0 for s in slopes) or all(s < 0 for s in slopes)
            twin_r2 = max((_fit(*t[by])[0] for t in own), default=0.0)
            odds = chance(r2, n)
            if not same_sign or twin_r2 >= TWIN_SHARE * r2 or r2 < SUGGESTIVE_R2 or odds > SUGGESTIVE_CHANCE:
                continue
            per_step = float(np.mean(slopes)) / (max(k, 1) if by == 'parameter' else 1)  # a call is k steps' decay
            trend = Trend(path, by, r2, odds, n, per_step, twin_r2, spacings, float(ends.max()), int(np.ndim(last)))
            (decisive if trend.decisive else suggestive).append(trend)
    rank = lambda t: -t.r2  # noqa: E731
    return Reading(tuple(sorted(decisive, key=rank)), tuple(sorted(suggestive, key=rank)), k * len(legacy))


def leaves(reading: Reading) -> list[LeafDiff]:
    """The decisive trends as leaves of the report (``trend/<by>/<leaf>``), outside their floor: a MISMATCH."""
    return [
        LeafDiff('trend', f'{t.by}/{t.leaf}', t.apart, t.r2, False, note=f'grows with the {t.by}, r² {t.r2:.3f}',
                 bad=t.values, size=t.values)
        for t in reading.decisive
    ]  # fmt: skip


# Where the first step was held and nothing before its update parted: nothing on the steps recorded (``LATER``), a
# later step parting only from parameters within their floors (``STARTS_APART``), or, against a reference of
# another JAX, nothing against the pmap code run here (``UPGRADE``). Any other reason for no place is a first step
# that parts earlier, or whose forward pass, loss or gradients were not seen to agree.
AGREED_BEFORE = (Unplaced.LATER, Unplaced.STARTS_APART, Unplaced.UPGRADE)


def may_place(found: Location | None, first_step_parts: bool) -> bool:
    """Whether a decisive trend may name the update rule, given the first step's location ``found`` and whether
    the verdict's own first-step leaves part (its loss, its gradients where probed): only where the forward pass,
    the loss and the gradients the optimizer is given agree on the first step. A relu for a softplus in a NeRF's
    density, its first loss apart (diagnosed math) and its module inputs not comparable, was read as 'the new side
    steps 0 x the pmap side': the relu had left some leaves no gradient, and so no step."""
    if found is None or first_step_parts:
        return False
    return found.kind == Where.NONE or found.why in AGREED_BEFORE


def location(reading: Reading, tested_ndims: frozenset) -> Location:
    """Where a decisive trend puts the sides' parting: the update rule, with what its factor implies.
    ``tested_ndims``: the ranks of the leaves the reading could judge (a trend on the 1-D ones alone, where
    larger ones were judged, is a weight-decay mask that differs)."""
    top = reading.decisive[0]
    same = [t for t in reading.decisive if t.by == top.by]
    ranks = {t.ndim for t in same}
    only = ranks == {1} and any(d > 1 for d in tested_ndims)
    on = (f'{len(same)} leaves' if len(same) > 1 else 'one leaf') + (' (1-D only: biases, scales)' if only else '')
    twins = max(t.twin_r2 for t in same)
    told = (f'{top.leaf} r² {top.r2:.3f} over {top.values} values, {top.spacings:.0f} float32 spacings apart after '
            f"{reading.steps} steps; the twins' r² at most {twins:.2f}")  # fmt: skip
    if top.by == 'parameter':
        more = 'more' if top.factor < 0 else 'less'
        implies = (f'the new side decays its parameters {more}, by {abs(top.factor):.2e} x the parameter a step: a '
                   'decoupled weight decay that differs (learning rate x weight decay), '
                   + ('a weight-decay mask that differs' if only else 'or an L2 term under SGD'))  # fmt: skip
    elif not uneven(same):
        implies = (
            f'the new side steps {1 + top.factor:.6g} x the pmap side: a learning rate or schedule value that '
            "differs by that factor, a gradient scale or clip under SGD, or an adaptive optimizer's eps, whose effect "
            'is such a factor where the second moment is small'
        )
    else:  # clipping makes the factor differ from leaf to leaf: a learning rate does not
        lo, hi = min(1 + t.factor for t in same), max(1 + t.factor for t in same)
        implies = (
            f'the new side steps {lo:.6g} to {hi:.6g} x the pmap side, a factor that differs from leaf to leaf: not '
            'one learning rate or schedule value; a gradient clipping that differs (by norm per sub-tree on one '
            "side and by the global norm or none on the other, or by value), an adaptive optimizer's eps, whose "
            'effect is such a factor where the second moment is small, or a rate per parameter'
        )
    figures = (f'every call, the difference grows in proportion to the {top.by} on {on} ({told}), below one '
               f"step's floor: {implies}")  # fmt: skip
    spread = (min(t.factor for t in same), max(t.factor for t in same)) if top.by == 'update' and uneven(same) else None
    values = located(step=reading.steps, by=top.by, leaf=top.leaf, r2=top.r2, factor=top.factor, leaves=len(same),
                     one_d_only=only, twin_r2=twins, spacings=top.spacings, factors=spread)  # fmt: skip
    return Location('update', 'the update rule', 'the update rule', figures, read=values)


UNEVEN = 2.0  # the largest of the leaves' per-step factors over the smallest: one factor would not spread so


def uneven(trends: list[Trend]) -> bool:
    """Whether the trends' per-step factors differ from leaf to leaf (signs apart, or more than ``UNEVEN`` times),
    as a clip makes them: one learning rate moves every leaf by one factor."""
    factors = [t.factor for t in trends]
    if len(factors) < 2:
        return False
    if min(factors) < 0 < max(factors):
        return True
    small, large = sorted(abs(f) for f in (min(factors), max(factors)))
    return large > UNEVEN * small


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    """How large a difference a MATCH could have missed, from each leaf's allowed difference against what the
    run moved it by: a learning rate off by ``learning_rate`` (relative) or more, or a decoupled weight decay of
    ``decay`` (learning rate x weight decay) a step or more, would have put some leaf past its floor by the last
    step. ``steps``: the steps it held (a difference n times smaller needs about n times as many)."""

    learning_rate: float | None
    learning_rate_leaf: str
    decay: float | None
    decay_leaf: str
    steps: int


def sensitivity(report, legacy: list, start: dict, steps: int) -> Sensitivity:
    """``Sensitivity`` from the report's parameter leaves (their ``limit``: what each was allowed), the pmap side's
    parameters after the last call and before the first (``start``); noise-dominated leaves verify nothing."""
    lr, decay = (np.inf, ''), (np.inf, '')
    last = legacy[-1] if legacy else {}
    for leaf in report.leaves:
        if leaf.group != 'params' or leaf.noise_dominated or leaf.limit is None or leaf.path not in last:
            continue
        end, begin = np.asarray(last[leaf.path], np.float64), start.get(leaf.path)
        if begin is not None and np.shape(begin) == end.shape:
            moved = float(np.abs(end - np.asarray(begin, np.float64)).max(initial=0.0))
            lr = min(lr, (leaf.limit / moved, leaf.path)) if moved > 0 else lr
        size = float(np.abs(end).max(initial=0.0)) * steps
        decay = min(decay, (leaf.limit / size, leaf.path)) if size > 0 else decay
    finite = lambda x: x[0] if np.isfinite(x[0]) else None  # noqa: E731
    return Sensitivity(finite(lr), lr[1], finite(decay), decay[1], steps)
