"""Leaf-by-leaf comparison of two neutral trees, with a tolerance that states its reason."""

import dataclasses

import ml_dtypes
import numpy as np

from equivalence.core.compare.outcome import Outcome
from equivalence.core.port.tolerance import FLOAT32_REDUCTION_ORDER, Tolerance, is_float  # noqa: F401 -- part of this API

Neutral = dict[str, dict[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class LeafDiff:
    group: str  # 'params', 'opt_state', 'ema', 'model_state', 'step', 'losses'
    path: str  # e.g. 'hidden/kernel', '1/0/mu/out/bias'
    max_abs: float
    max_rel: float  # max |a - b| / |b| over elements where b != 0
    ok: bool
    note: str = ''  # why a leaf could not be compared element-wise
    bad: int = 0  # elements outside tolerance
    size: int = 0  # elements compared
    floor: float | None = None  # measured noise floor, max |nnx - twin| (compare_to_floor only) ...
    floor_from: str = ''  # ... or 'legacy' where max |legacy - legacy twin| was larger and set it
    limit: float | None = None  # the max |nnx - legacy| allowed: FloorRule.limit
    noise_dominated: bool = False  # the floor itself is large: the final value cannot verify this leaf
    one_sided: str = ''  # 'legacy' or 'new' when the leaf exists on that side only

    @property
    def name(self) -> str:
        return f'{self.group}/{self.path}'


def compare_leaf(group: str, path: str, ref: np.ndarray, other: np.ndarray, tol: Tolerance) -> LeafDiff:
    if ref.shape != other.shape:
        return LeafDiff(group, path, np.inf, np.inf, False, f'shape {other.shape} vs {ref.shape}')
    if not is_float(ref.dtype):  # counters: exactly equal or wrong
        diff = np.abs(other.astype(np.int64) - ref.astype(np.int64))
        bad = int((diff != 0).sum())
        return LeafDiff(
            group, path, float(diff.max(initial=0)), float(diff.max(initial=0)), not bad, '', bad, diff.size
        )
    ref64, other64 = ref.astype(np.float64), other.astype(np.float64)
    diff = np.abs(other64 - ref64)
    nonzero = np.abs(ref64) > 0
    rel = float((diff[nonzero] / np.abs(ref64[nonzero])).max(initial=0.0))
    bad = int((~(diff <= tol.atol + tol.rtol * np.abs(ref64))).sum())  # NaN counts as outside
    return LeafDiff(group, path, float(diff.max(initial=0.0)), rel, not bad, '', bad, diff.size)


def one_sided(group: str, path: str, side: str) -> LeafDiff:
    return LeafDiff(group, path, np.inf, np.inf, False, f'only on the {side} side', one_sided=side)


@dataclasses.dataclass(frozen=True)
class Report:
    leaves: list[LeafDiff]
    tolerance: Tolerance
    floor: 'FloorRule | None' = None  # set when a twin measured each leaf's noise floor

    @property
    def legacy_twin(self) -> bool:
        """Whether a legacy twin's spread set some leaf's floor."""
        return any(leaf.floor_from == 'legacy' for leaf in self.leaves)

    @property
    def match(self) -> bool:
        """Every leaf within its tolerance or floor (the verdict decides its outcome from this and its own
        reasons for NOT VERIFIED: ``rule.Verdict.outcome``)."""
        return all(leaf.ok for leaf in self.leaves)

    @property
    def outcome(self) -> Outcome:
        """MATCH or MISMATCH of this comparison alone, for what compares without a verdict (bench's agreement,
        a pitfall's own comparison); a check's outcome is its verdict's (``RunResult.outcome``)."""
        return Outcome.of(self.match)

    def max_abs(self, group: str) -> float:
        return max((leaf.max_abs for leaf in self.leaves if leaf.group == group), default=0.0)

    def worst(self, n: int = 5) -> list[LeafDiff]:
        return sorted(self.leaves, key=lambda leaf: (leaf.ok, -leaf.max_abs))[:n]


def compare(ref: Neutral, other: Neutral, tol: Tolerance = FLOAT32_REDUCTION_ORDER) -> Report:
    """Every leaf of ``ref`` against ``other``; a leaf on one side only is a mismatch."""
    leaves = []
    for group in sorted(set(ref) | set(other)):
        a, b = ref.get(group, {}), other.get(group, {})
        for path in sorted(set(a) | set(b)):
            if path not in a or path not in b:
                leaves.append(one_sided(group, path, 'legacy' if path in a else 'new'))
            else:
                leaves.append(compare_leaf(group, path, a[path], b[path], tol))
    return Report(leaves, tol)


@dataclasses.dataclass(frozen=True)
class FloorRule:
    """What "match" means for a leaf whose noise floor a twin run measured (``compare_to_floor``)."""

    safety: float  # ok when max |nnx - legacy| <= safety * max |nnx - twin| ...
    min_ulps: float  # ... or <= this many spacings of the leaf's largest |legacy| (float32's, or its narrower dtype's)
    noise_rel: float  # noise-dominated when max |nnx - twin| > noise_rel * max(max |legacy|, max |nnx|), and > rounding
    reason: str
    flips: float = 0.0  # ... or, fed by optimizer state narrower than float32, this many ``moved_spacing``s

    def limit(self, floor: float, scale: float, dtype=np.float32, moved: float = 0.0) -> float:
        """The largest difference allowed a leaf of ``dtype`` with this floor whose largest |value| is
        ``scale``; ``moved``: its ``moved_spacing`` (0 when no narrower state feeds it)."""
        return max(self.safety * floor, self.min_ulps * own_spacing(scale, dtype), self.flips * moved)

    def rounding(self, scale: float, dtype=np.float32, moved: float = 0.0) -> float:
        """The largest floor that is rounding in the leaf's own precision, never noise-dominated: ``min_ulps`` of its
        rounding units, its dtype's spacings at ``scale`` or, fed by narrower state, its ``moved_spacing``s. Below
        ``noise_rel`` of any float32 leaf's scale; for bfloat16 state, one element rounded to its neighbouring value
        is 2^-8 of it, above ``noise_rel`` (docs/verdict.md, precision)."""
        return self.min_ulps * max(own_spacing(scale, dtype), moved)


def spacing32(x: float) -> float:
    """The float32 spacing (one ulp) at ``|x|``; the smallest subnormal at 0."""
    return float(np.spacing(np.float32(abs(x))))


def spacing(x: float, dtype) -> float:
    """The spacing of ``dtype`` (float32, bfloat16, float16, ...) at ``|x|``, ``|x|`` rounded to it first."""
    return float(np.spacing(np.asarray(abs(x)).astype(dtype)))


def narrower(dtype) -> bool:
    """A float dtype with fewer significand bits than float32 (bfloat16, float16, float8)."""
    return is_float(dtype) and ml_dtypes.finfo(dtype).nmant < ml_dtypes.finfo(np.float32).nmant


def own_spacing(scale: float, dtype=np.float32) -> float:
    """A leaf's rounding unit at ``scale``, what ``FloorRule.min_ulps`` counts: the float32 spacing, or
    the spacing of its own dtype where that is narrower (a bfloat16 moment rounds in bfloat16 steps)."""
    return spacing(scale, dtype) if narrower(dtype) else spacing32(scale)


def moved_spacing(ref: np.ndarray, fed_by=None, start: np.ndarray | None = None) -> float:
    """What ``FloorRule.flips`` counts for a leaf whose updates come from optimizer state narrower than
    float32 (``fed_by``: a bfloat16 moment): the spacing of that dtype at the leaf's largest change since
    ``start``. The change is a sum of updates built from the moment; where two runs round one element of
    it to neighbouring values (their float32 gradients differ in the last bits), that element's update
    changes by one part in 2^8 and momentum carries it on: about one such spacing at most (docs/verdict.md,
    precision). 0 when nothing narrower feeds it, or without ``start``."""
    if fed_by is None or start is None or start.shape != ref.shape:
        return 0.0
    return spacing(float(np.abs(ref.astype(np.float64) - start.astype(np.float64)).max(initial=0.0)), fed_by)


def feeding_dtypes(tree: Neutral) -> dict[str, np.dtype]:
    """``{parameter path: the narrowest dtype of the optimizer state that feeds it}``, for parameters
    fed by state narrower than float32 (an optax ``mu_dtype`` or ``accumulator_dtype``): optimizer-state
    paths end in the parameter's (``1/0/trace/head/kernel`` feeds ``head/kernel``)."""
    out: dict[str, np.dtype] = {}
    params, state = tree.get('params', {}), tree.get('opt_state', {})
    for path, a in state.items():
        if not narrower(a.dtype):
            continue
        parts = path.split('/')
        owner = next(('/'.join(parts[i:]) for i in range(len(parts)) if '/'.join(parts[i:]) in params), None)
        bits = lambda d: ml_dtypes.finfo(d).nmant  # noqa: E731
        if owner is not None and (owner not in out or bits(a.dtype) < bits(out[owner])):
            out[owner] = a.dtype
    return out


def floor_leaf(
    group: str,
    path: str,
    ref: np.ndarray,
    other: np.ndarray,
    twin: np.ndarray,
    rule: FloorRule,
    ref_twin: np.ndarray | None = None,
    fed_by=None,
    start: np.ndarray | None = None,
):
    """One float leaf held to its own measured floor, the larger of ``|other - twin|`` and, given a
    finite ``ref_twin`` of its shape, ``|ref - ref_twin|``, and to ``rule.limit`` in its own precision
    (``fed_by``, ``start``: see ``moved_spacing``); counters and shapes as ``compare_leaf``."""
    screened = compare_leaf(group, path, ref, other, Tolerance(0.0, 0.0, ''))
    if screened.note or not is_float(ref.dtype) or twin.shape != other.shape:
        return screened
    if not (np.isfinite(ref).all() and np.isfinite(other).all() and np.isfinite(twin).all()):
        return dataclasses.replace(screened, ok=False, note=nonfinite_note(ref, other))
    ref64, other64 = ref.astype(np.float64), other.astype(np.float64)
    floor, floor_from = float(np.abs(other64 - twin.astype(np.float64)).max(initial=0.0)), ''
    if ref_twin is not None and ref_twin.shape == ref.shape and np.isfinite(ref_twin).all():
        spread = float(np.abs(ref64 - ref_twin.astype(np.float64)).max(initial=0.0))
        floor, floor_from = (spread, 'legacy') if spread > floor else (floor, '')
    scale, moved = float(np.abs(ref64).max(initial=0.0)), moved_spacing(ref, fed_by, start)
    limit = rule.limit(floor, scale, ref.dtype, moved)
    # the leaf's own scale is the larger side's: a zero-initialised layer still 0 on the pmap side is not
    # noise-dominated by any floor at all where the new side moved it (vision_transformer's head, tried blind)
    noisy = floor > rule.noise_rel * max(scale, float(np.abs(other64).max(initial=0.0))) and floor > rule.rounding(
        scale, ref.dtype, moved
    )
    bad = int((np.abs(other64 - ref64) > limit).sum())
    return dataclasses.replace(
        screened, ok=noisy or not bad, bad=bad, floor=floor, limit=limit, noise_dominated=noisy, floor_from=floor_from
    )


def nonfinite_note(ref: np.ndarray, other: np.ndarray) -> str:
    """Which side holds NaN or Inf; identical non-finite values are said to be identical, not 'max rel 0'."""
    a, b = ~np.isfinite(ref), ~np.isfinite(other)
    if np.array_equal(a, b) and np.array_equal(ref[a], other[b], equal_nan=True):
        return f'non-finite on both sides alike ({int(a.sum()):,} elements)'
    sides = [s for s, m in (('legacy', a), ('new', b)) if m.any()]
    return f'non-finite on the {" and ".join(sides)} side' if sides else 'non-finite in the twin'


def compare_to_floor(
    ref: Neutral,
    other: Neutral,
    twin: Neutral,
    rule: FloorRule,
    ref_twin: Neutral | None = None,
    start: dict[str, np.ndarray] | None = None,
) -> Report:
    """Every leaf of ``ref`` (legacy) against ``other`` (NNX), each within its own floor, what
    ``other`` differs from ``twin`` by (the same NNX run, only the reductions reordered), or, where
    ``ref_twin`` (the legacy run again on another device count) is given and farther, what ``ref``
    differs from it by. ``start``: the parameters before training (by path), for parameters and EMA
    fed by optimizer state narrower than float32 (``moved_spacing``)."""
    leaves, fed = [], feeding_dtypes(ref)
    for group in sorted(set(ref) | set(other)):
        a, b, t, r = ref.get(group, {}), other.get(group, {}), twin.get(group, {}), (ref_twin or {}).get(group, {})
        for path in sorted(set(a) | set(b)):
            if path not in a or path not in b:
                leaves.append(one_sided(group, path, 'legacy' if path in a else 'new'))
                continue
            fed_by = fed.get(path) if group in ('params', 'ema') else None
            begin = (start or {}).get(path) if fed_by is not None else None
            leaf = floor_leaf(group, path, a[path], b[path], t.get(path, b[path]), rule, r.get(path), fed_by, begin)
            leaves.append(leaf)
    return Report(leaves, FLOAT32_REDUCTION_ORDER, rule)
