"""Leaf-by-leaf comparison of two neutral trees, with a tolerance that states its reason."""

import dataclasses

import numpy as np

Neutral = dict[str, dict[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float  # per element: |nnx - legacy| <= atol + rtol * |legacy|
    atol: float
    reason: str


# The pmap loss is a mean of per-device means, the sharded loss one global mean; their
# gradients are summed in different orders, so they differ in the last bits (float32
# eps = 1.2e-7), and Adam's normalised steps carry that rounding into every parameter.
FLOAT32_REDUCTION_ORDER = Tolerance(
    rtol=1e-5,
    atol=1e-6,
    reason='float32 reduction order: pmean of per-device means vs one global mean',
)


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

    @property
    def name(self) -> str:
        return f'{self.group}/{self.path}'


def compare_leaf(group: str, path: str, ref: np.ndarray, other: np.ndarray, tol: Tolerance) -> LeafDiff:
    if ref.shape != other.shape:
        return LeafDiff(group, path, np.inf, np.inf, False, f'shape {other.shape} vs {ref.shape}')
    if not np.issubdtype(ref.dtype, np.floating):  # counters: exactly equal or wrong
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


@dataclasses.dataclass(frozen=True)
class Report:
    leaves: list[LeafDiff]
    tolerance: Tolerance

    @property
    def match(self) -> bool:
        return all(leaf.ok for leaf in self.leaves)

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
                side = 'legacy' if path in a else 'nnx'
                leaves.append(LeafDiff(group, path, np.inf, np.inf, False, f'only on the {side} side'))
            else:
                leaves.append(compare_leaf(group, path, a[path], b[path], tol))
    return Report(leaves, tol)
