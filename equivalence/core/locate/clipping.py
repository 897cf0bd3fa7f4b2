"""Gradient clipping, read from what each side's optimizer was given: its first moments after one step from 0
(Adam's ``mu`` is ``(1 - b1) g``, SGD momentum's ``trace`` is ``g``), by leaf ``(pmap, new, allowed difference)``
(no JAX).

- **By norm, per sub-tree or globally.** A clip by norm scales a whole tree of gradients by one factor. Clipped per
  sub-tree on one side (each MLP of a NeRF, as its codebase's ``clip_gradients`` does) and by the global norm (or
  not at all) on the other, the two sides' moments part by one factor in each sub-tree, another from one sub-tree
  to the next (``subtrees``); the side that clips per sub-tree holds one norm in every sub-tree it clipped.
- **By value.** A clip by value leaves every element it clipped at one magnitude, and the others as they were
  (``by_value``): the factor changes from element to element.
"""

import dataclasses

import numpy as np

SAME_NORM = 1e-3  # relative: sub-trees clipped to one norm hold it up to rounding (and the clip's eps / norm)
SATURATED = 1e-5  # relative spread of one magnitude: a clip's value, held by every element it clipped


def _factor(a: np.ndarray, b: np.ndarray) -> float | None:
    """``c`` of ``b ~ c a`` through 0 (None where ``a`` is 0)."""
    return float(b @ a / (a @ a)) if a @ a > 0 else None


def fits(a: np.ndarray, b: np.ndarray, allowed: float, c: float) -> bool:
    """Whether ``b`` is ``c a`` within ``allowed`` (times ``c`` where it is above 1)."""
    return float(np.max(np.abs(b - c * a), initial=0.0)) <= allowed * max(1.0, abs(c))


@dataclasses.dataclass(frozen=True)
class Subtrees:
    """The moments part by one factor per sub-tree (``factors``: ``(sub-tree, new / pmap)``), each the same over
    its leaves; ``clipped``: the side (``'pmap'`` or ``'new'``) whose sub-trees hold one norm, ``norm`` (of the
    slot: each sub-tree's gradients clipped by norm to it); ``other``: the other side's global norm of the slot,
    and ``other_per_subtree`` where it too holds one norm in every sub-tree it clipped (then at ``other``)."""

    factors: tuple[tuple[str, float], ...]
    clipped: str | None = None
    norm: float | None = None
    other: float | None = None
    other_per_subtree: bool = False

    @property
    def global_same(self) -> bool:
        """The other side's global norm is the clipped side's per sub-tree: a clip by the global norm, same value."""
        return self.clipped is not None and abs(self.other - self.norm) <= SAME_NORM * self.norm


def _parts(path: str) -> tuple[str, ...]:
    return tuple(path.split('/'))


def _groups(leaves: dict, depth: int, prefix: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in leaves:
        out.setdefault('/'.join(_parts(path)[prefix : prefix + depth]), []).append(path)
    return out


def subtrees(leaves: dict[str, tuple[np.ndarray, np.ndarray, float]]) -> Subtrees | None:
    """``Subtrees`` where the shallowest grouping of the leaves by path below what they all share (a slot's ``0/mu``)
    gives two or more sub-trees, one holding two leaves or more, each fitting one factor of its own, the factors
    positive and not all one; None otherwise (one factor everywhere, or one a leaf, is no finding of a sub-tree)."""
    paths = [_parts(p) for p in leaves]
    if len(paths) < 3:
        return None
    prefix = next((i for i in range(min(map(len, paths))) if len({p[i] for p in paths}) > 1), None)
    if prefix is None:
        return None
    for depth in range(1, max(map(len, paths)) - prefix):
        groups = _groups(leaves, depth, prefix)
        if len(groups) < 2 or all(len(g) < 2 for g in groups.values()):
            continue
        cat = lambda g, i: np.concatenate([leaves[p][i] for p in g])  # noqa: E731
        factors = {name: _factor(cat(g, 0), cat(g, 1)) for name, g in groups.items()}
        if any(c is None or c <= 0 for c in factors.values()):
            return None
        if not all(fits(*leaves[p], factors[name]) for name, g in groups.items() for p in g):
            continue
        if max(factors.values()) - min(factors.values()) <= SAME_NORM * max(factors.values()):
            return None
        return _norms(leaves, groups, tuple(sorted(factors.items())))
    return None


def _norms(leaves: dict, groups: dict[str, list[str]], factors: tuple) -> Subtrees:
    """The side whose sub-trees hold one norm (the largest there, in two sub-trees or more): each clipped to it."""
    norm = lambda g, i: float(np.sqrt(sum(float(leaves[p][i] @ leaves[p][i]) for p in g)))  # noqa: E731
    held = []
    for i in (0, 1):
        norms = [norm(g, i) for g in groups.values()]
        top = max(norms)
        held.append(top if top > 0 and sum(abs(n - top) <= SAME_NORM * top for n in norms) >= 2 else None)
    for i, side in ((0, 'pmap'), (1, 'new')):
        if held[i] is not None:
            other = norm(list(leaves), 1 - i)
            return Subtrees(factors, side, held[i], other if held[1 - i] is None else held[1 - i],
                            held[1 - i] is not None)  # fmt: skip
    return Subtrees(factors)


def by_value(leaves: list[tuple[np.ndarray, np.ndarray, float]]) -> tuple[str, float, int, int] | None:
    """``(side, magnitude, elements clipped, elements that part)`` where three or more of the elements that part
    hold one magnitude on one side, the largest there, and every element not at that magnitude is one factor of the
    other side's in its leaf (a clip by norm that differs too, or none); None otherwise. An element at that
    magnitude on both sides (the other side's clip by norm left it there) is clipped too, and parts nowhere."""
    parts = [(a, b, lim, np.abs(b - a) > lim) for a, b, lim in leaves]
    apart = sum(int(m.sum()) for *_, m in parts)
    for side, i in (('pmap', 0), ('new', 1)):
        top = max((float(np.abs((a, b)[i][m]).max(initial=0.0)) for a, b, _, m in parts), default=0.0)
        if top <= 0:
            continue
        held = [np.abs((a, b)[i]) >= top * (1 - SATURATED) for a, b, _, _ in parts]  # parting there or not
        clipped = sum(int((h & m).sum()) for h, (*_, m) in zip(held, parts, strict=True))
        if clipped < 3:
            continue
        rest = [(a[~h], b[~h], lim) for (a, b, lim, _), h in zip(parts, held, strict=True)]
        if all(fits(a, b, lim, _factor(a, b) or 1.0) for a, b, lim in rest):
            return side, top, clipped, apart
    return None
