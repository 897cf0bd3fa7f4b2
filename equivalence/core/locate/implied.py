"""What a first update and a first statistics update imply: numbers in, a sentence out (no JAX).

Each side's first update of the parameters is ``u = p1 - p0``. Their difference
``d = u_nnx - u_pmap`` is fitted through 0 as

- ``c * u_pmap``: one factor on the whole step (a learning rate, a schedule value, a gradient
  scale; Adam's first nesterov step is ``(1 + 2 b1) / (1 + b1)`` times the plain one, 1.4737 at
  b1 0.9);
- ``c * p0``: decoupled weight decay, ``c = lr x (pmap decay - NNX decay)``;
- ``c * u_pmap / (|g| + eps_nnx)``: an adaptive optimizer's eps. Adam's first step is
  ``lr g / (|g| + eps)``, so ``1 / |u| = 1 / lr + (eps / lr) / |g|``: a straight line in ``1 / |g|``
  whose slope over its intercept is each side's eps (``adam_eps``), and ``c = eps_pmap - eps_nnx``;

and the form that explains it (r² >= 0.9) is said. A running mean updated as
``new = m old + (1 - m) batch mean`` gives each side's momentum ``m`` by least squares.
"""

import dataclasses

import numpy as np

from equivalence.core.compare.location import read
from equivalence.core.locate import clipping

NESTEROV_B1 = 0.9  # Adam's default b1
EXPLAINED = 0.9  # r² a form must reach to be named


def flat(tree: dict, keys) -> np.ndarray:
    """The leaves ``keys`` of a flat tree (path -> array), in float64, end to end: what ``fit`` fits."""
    return np.concatenate([np.asarray(tree[k], np.float64).ravel() for k in keys])


def fit(d: np.ndarray, x: np.ndarray) -> tuple[float, float]:
    """``(c, r²)`` of ``d ~ c x`` through 0."""
    if x @ x == 0 or d @ d == 0:
        return 0.0, 0.0
    c = float(d @ x / (x @ x))
    return c, 1 - float((d - c * x) @ (d - c * x) / (d @ d))


def update(p0: np.ndarray, u_old: np.ndarray, u_new: np.ndarray, g: np.ndarray | None, assumed: bool,
           kernels: np.ndarray | None = None, step: int = 1,
           moments_agree: bool = False) -> tuple[str, tuple]:  # fmt: skip
    """``(the sentence, its numbers as a Location.read: ``update`` (the form read), ``update_factor``,
    ``update_r2``, ``decay``, ``eps``)``: what the updates ``u_old`` (pmap) and ``u_new`` (NNX) of step
    ``step`` from ``p0`` imply, given the pmap side's gradient ``g`` (None: not observed; ``assumed``:
    estimated from Adam's first moment); ``kernels``: which elements are of a parameter of two or more axes
    (a weight decay masked to them).
    An adaptive optimizer's eps, and nesterov's factor, are read on step 1 alone: only there is the
    update one gradient's (``g / (|g| + eps)`` from moments at 0); on a later step the moments hold the
    earlier gradients too (a warmup's zero first update hid the slip until then), and no reading of them
    is made: a step factor (a learning rate, a schedule) and a decoupled weight decay still read the same.
    ``moments_agree``: the optimizer's first moments, which hold the gradients, agree on both sides, so a step
    factor is not a gradient scale (vision_transformer's learning rate 10 x, tried blind, read 'a learning rate
    or schedule value ..., or a gradient scale' beside 'every optimizer slot agree')."""
    live = np.abs(u_old) > 0
    if not live.any():
        return NO_UPDATE, read(update='none')
    d = u_new - u_old
    masked = masked_decay(d, p0, kernels)
    if masked[0]:
        return masked
    fits = {'lr': fit(d, u_old), 'decay': fit(d, p0)}
    eps = (adam_eps(g, u_old), adam_eps(g, u_new)) if g is not None and step == 1 else (None, None)
    if eps[1] is not None:
        ok = live & (np.abs(g) > 0)
        fits['eps'] = fit(d[ok], u_old[ok] / (np.abs(g[ok]) + eps[1]))
    form, (c, r2) = max(fits.items(), key=lambda kv: kv[1][1])
    if r2 < EXPLAINED:
        ratio = float(np.median(u_new[live] / u_old[live]))
        forms = ['one step factor', 'weight decay (of every parameter, or of the kernels or the biases alone)']
        tried = f'{", ".join(forms)} or eps' if 'eps' in fits else ' or '.join(forms)
        later = f'; the moments of step {step} hold earlier gradients too: what they imply is not read'
        later = later if step > 1 else ''
        text = f'the new side steps {ratio:.6g} x the pmap side (median): no {tried} fits it (r² {r2:.2f}){later}'
        return text, read(update='unexplained', update_factor=ratio, update_r2=r2)
    if form == 'lr':
        first = (1 + 2 * NESTEROV_B1) / (1 + NESTEROV_B1)
        text = f'the new side steps {1 + c:.6g} x the pmap side (r² {r2:.3f})'
        if step == 1 and min(abs(1 + c - first), abs(1 / (1 + c) - first)) < 1e-3 * first:
            text += f', what nesterov gives Adam (b1 {NESTEROV_B1}) on its first step: {first:.4f}'
            return text, read(update='nesterov', update_factor=1 + c, update_r2=r2)
        text += ': a learning rate or schedule value that differs by that factor'
        text += ' (not a gradient scale: the first moments agree)' if moments_agree else ', or a gradient scale'
        return text, read(update='step factor', update_factor=1 + c, update_r2=r2)
    if form == 'decay':
        text = f'a difference of {c:.3g} x the parameter (r² {r2:.3f}): a decoupled weight decay, lr x (pmap - NNX)'
        return text, read(update='decay', decay=c, update_r2=r2)
    how = f', |g| from the first moment with b1 {NESTEROV_B1}' if assumed else ''
    sides = (
        f'about {eps[0]:.2g} on the pmap side, {eps[1]:.2g} in NNX' if eps[0] is not None else f'NNX - pmap {-c:.2g}'
    )
    text = f"a difference that grows as |g| shrinks (r² {r2:.3f}): an adaptive optimizer's eps, {sides}{how}"
    return text, read(update='eps', update_r2=r2, eps=eps if eps[0] is not None else None)


NO_UPDATE = 'no update on the pmap side (a learning rate of 0 at this step)'


def masked_decay(d: np.ndarray, p0: np.ndarray, kernels: np.ndarray | None) -> tuple[str, tuple]:
    """``('', ())`` unless the updates differ by a multiple of the parameter on one kind of leaf alone (the kernels, or
    the biases and scales) and by nothing on the other (r² >= ``EXPLAINED`` there, the rest within a
    thousandth of it): a weight decay whose mask differs (``optax.add_decayed_weights(wd, mask=...)``, or
    ``adamw``'s ``mask``; lm1b's port tried blind decayed its biases and scales too, and read 'not one step
    factor or weight decay alone')."""
    if kernels is None or not kernels.any() or kernels.all():
        return '', ()
    for on, what, rest_of in ((kernels, 'the kernels', 'the biases and scales'),
                              (~kernels, 'the biases and scales', 'the kernels')):  # fmt: skip
        c, r2 = fit(d[on], p0[on])
        rest = float(np.abs(d[~on]).max(initial=0.0))
        if r2 >= EXPLAINED and rest <= 1e-3 * float(np.abs(d[on]).max(initial=0.0)):
            return (
                f'a difference of {c:.3g} x the parameter on {what} (r² {r2:.3f}) and none on {rest_of}: a weight '
                f'decay whose mask differs, {what} decayed on one side only (new - pmap); c is -lr x decay where it '
                'is decoupled (adamw), -decay where it is added after the learning-rate scale (add_decayed_weights '
                'after scale_by_learning_rate)'
            ), read(update='masked decay', decay=c, update_r2=r2, decayed='kernels' if on is kernels else 'others')
    return '', ()


def adam_eps(g: np.ndarray, u: np.ndarray) -> float | None:
    """The eps of an Adam first step ``u = lr g / (|g| + eps)``: slope over intercept of ``1 / |u|``
    against ``1 / |g|``; None where that line says no eps (a decay or another form dominates)."""
    ok = (np.abs(u) > 0) & (np.abs(g) > 0)
    if ok.sum() < 3:
        return None
    x, y = 1 / np.abs(g[ok]), 1 / np.abs(u[ok])
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), y, rcond=None)
    return float(b / a) if a > 0 and b >= 0 else None


def momentum(old: np.ndarray, new: np.ndarray, batch_mean: np.ndarray) -> float | None:
    """``m`` of ``new = m old + (1 - m) batch_mean``, by least squares; None when ``old`` is the batch mean."""
    a = np.asarray(old, np.float64).ravel() - batch_mean
    b = np.asarray(new, np.float64).ravel() - batch_mean
    return float(a @ b / (a @ a)) if a @ a > 0 else None


@dataclasses.dataclass(frozen=True)
class Moments:
    """What the first-step optimizer slots of one kind (``mu``, ``nu``, ``trace``) say: ``even`` when
    one factor ``factor`` scales every leaf (None: not one factor), the leaf that parts most over its
    allowed difference, and the sentence."""

    even: bool
    factor: float | None
    leaf: str
    text: str
    uneven: bool = False  # the slots part by no factor at all: the gradients themselves differ
    proportional: float | None = None  # uneven, their difference that multiple of the parameters (an L2 term, a decay)
    clipped: bool = False  # uneven, one side's parting elements clipped to one magnitude: an element-wise gradient clip
    subtrees: clipping.Subtrees | None = None  # one factor per sub-tree (a clip by norm per sub-tree on one side)
    read: tuple = ()  # the sentence's numbers, as values by name (``location.read``): what ``Location.read`` takes

    def values(self) -> dict:
        """The numbers the sentence says, by name: ``factor`` (NNX / pmap) and what it implies (``b1``; for ``nu``,
        ``gradient_factor``: every gradient scaled by it), ``factors`` (a factor per leaf: the lowest and highest),
        ``ratio`` (5th, 95th percentile), ``zeros`` (leaves that part where the pmap side's are 0), ``proportional``
        (the slots' difference over the parameter), ``r2`` and ``l2`` (the gradients' difference over the parameter:
        an L2 term's 2 x coefficient, if b1 is 0.9 for ``mu``), ``clip`` (the side, ``pmap`` or ``new``, and the
        magnitude), ``subtrees`` (each sub-tree's factor), ``clip_norm`` (the side that clips per sub-tree, the slot's
        norm there, the other side's global norm)."""
        return dict(self.read)


def _ratios(a: np.ndarray, b: np.ndarray, allowed: float) -> tuple[float, float]:
    """The 5th and 95th percentile of ``b / a`` where ``|a|`` is above what a leaf may differ by."""
    ok = np.abs(a) > allowed
    if ok.sum() < 2:
        ok = a != 0
    r = b[ok] / a[ok] if ok.any() else np.array([np.nan])
    return float(np.percentile(r, 5)), float(np.percentile(r, 95))


def moments(
    slot: str, leaves: dict[str, tuple[np.ndarray, np.ndarray, float]], p0: dict[str, np.ndarray] | None = None
) -> Moments | None:
    """Slot ``slot`` (``mu``: Adam's first moment, ``(1 - b1) g`` after one step from 0; ``trace``:
    SGD's momentum, ``g``; ``nu``: Adam's second moment, ``(1 - b2) g²``) on each side, by leaf:
    ``(pmap, NNX, allowed difference)``; None when no leaf parts.

    A change of b1, b2 or of one gradient scale (a clip by global norm, a loss scale or reduction)
    multiplies every element of every leaf by ONE factor; gradients that differ (a training loss, a
    backward pass) do not. The factor is fitted through 0 over all leaves, and every leaf's residual
    held to its allowed difference (times the factor where it is above 1); failing that, one factor
    per leaf; failing that, it is uneven: the gradients differ. Where their difference is a multiple of
    the parameters ``p0`` (by leaf, before the step) over the leaves that part, it is said: an L2 term
    in the training loss and a coupled weight decay (added to the gradient before the moment) give
    the same numbers."""
    leaves = {
        k: (np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel(), lim)
        for k, (a, b, lim) in leaves.items()
    }
    over = {
        k: float(np.max(np.abs(b - a), initial=0) / lim) if lim > 0 else np.inf for k, (a, b, lim) in leaves.items()
    }
    if not over or max(over.values()) <= 1:
        return None
    worst = max(over, key=over.get)
    a_all = np.concatenate([a for a, _, _ in leaves.values()])
    b_all = np.concatenate([b for _, b, _ in leaves.values()])
    if a_all @ a_all == 0:
        return Moments(
            False, None, worst, f"the pmap side's {slot} is 0 everywhere, the NNX side's is not: no factor relates them"
        )
    c, _ = fit(b_all, a_all)  # one factor through 0, over every element
    fits = clipping.fits
    if all(fits(a, b, lim, c) for a, b, lim in leaves.values()):
        return Moments(
            True,
            c,
            worst,
            f'the {slot} slots part by one factor on every element of every leaf: '
            f'NNX = {c:.6g} x pmap; ' + _factor(slot, c),
            read=read(
                factor=c,
                b1=1 - c * (1 - NESTEROV_B1) if slot == 'mu' else None,
                gradient_factor=np.sqrt(abs(c)) if slot == 'nu' else None,
            ),
        )
    apart = [k for k in leaves if over[k] > 1]
    lo, hi = _ratios(*(np.concatenate([leaves[k][i] for k in apart]) for i in (0, 1)), max(leaves[k][2] for k in apart))
    per_leaf = {k: fit(b, a)[0] if a @ a > 0 else 1.0 for k, (a, b, _) in leaves.items()}
    if all(fits(a, b, lim, per_leaf[k]) for k, (a, b, lim) in leaves.items()):
        grouped = clipping.subtrees(leaves) if slot in ('mu', 'trace') else None
        if grouped is not None:
            return _subtrees(slot, worst, grouped)
        cs = [per_leaf[k] for k, (a, _, _) in leaves.items() if a @ a > 0]
        return Moments(
            False,
            None,
            worst,
            f"each leaf's {slot} is one factor of the other side's, but the factor "
            f'differs from leaf to leaf ({min(cs):.4g} to {max(cs):.4g}; {worst}: {per_leaf[worst]:.4g}): '
            'a per-parameter scale (a per-leaf clip, a layer-wise rate) or a loss term that scales whole '
            "parameters' gradients; the numbers do not tell which",
            read=read(factors=(min(cs), max(cs))),
        )
    what = 'first moments' if slot in ('mu', 'trace') else f'{slot} slots'
    ratio = (
        f'ratio NNX/pmap from {lo:.4g} to {hi:.4g}, 5th to 95th percentile over the {len(apart)} leaves that part'
        if np.isfinite(lo) and np.isfinite(hi)  # no ratio where the pmap side's are 0 (a zero head's gradients)
        else f"the pmap side's are 0 wherever the {len(apart)} leaves that part do"
    )
    text = f'the {what} part unevenly ({ratio}; most over its floor: {worst}): '
    spread = read(ratio=(lo, hi)) if np.isfinite(lo) and np.isfinite(hi) else read(zeros=len(apart))
    held = clipping.by_value([leaves[k] for k in apart]) if slot in ('mu', 'trace') else None
    if held is not None:
        side, top, n, of = held
        every = 'every element that parts holds' if n == of else f'{n} of the {of} elements that part hold'
        rest = '' if n == of else ', the others one factor of the other side a leaf (a clip by norm that differs too)'
        return Moments(
            False, None, worst,
            text + f"{every} one magnitude on the {side} side ({top:.6g}){rest}: the gradients are clipped "
            f"element-wise there ({'(1 - b1) x ' if slot == 'mu' else ''}the clip value; optax.clip), with another "
            'value or none on the other side',
            uneven=True, clipped=True, read=spread + read(clip=(side, top), clipped=(n, of)),
        )  # fmt: skip
    parted = [k for k in leaves if over[k] > 1 and p0 is not None and k in p0]
    if slot in ('mu', 'trace') and parted:
        d = np.concatenate([leaves[k][1] - leaves[k][0] for k in parted])
        c, r2 = fit(d, np.concatenate([np.asarray(p0[k], np.float64).ravel() for k in parted]))
        if r2 >= EXPLAINED:
            g = f'{c / (1 - NESTEROV_B1):.3g}' if slot == 'mu' else f'{c:.3g}'
            b1 = f' if b1 is {NESTEROV_B1}' if slot == 'mu' else ''
            return Moments(
                False,
                None,
                worst,
                text + f'over the {len(parted)} leaves that part, the difference is {c:.3g} x the parameter (r² '
                f'{r2:.3f}): the gradients the moment is given differ by {g} x the parameter{b1}, an L2 term in the '
                'training loss (NNX - pmap) or a coupled weight decay (added to the gradient before the moment); '
                'the numbers do not tell which. Not b1, a momentum or a clip by global norm (one factor would scale '
                'them all)',
                uneven=True,
                proportional=c,
                read=spread + read(proportional=c, r2=r2, l2=c / (1 - NESTEROV_B1) if slot == 'mu' else c),
            )
    text += (
        "the gradients differ, the training loss or the backward pass; not the optimizer's settings (one factor "
        'would scale them all)'
    )
    return Moments(False, None, worst, text, uneven=True, read=spread)


def _factor(slot: str, c: float) -> str:
    if slot == 'mu':
        return (
            f"(1 - b1) differs by that factor (NNX b1 {1 - c * (1 - NESTEROV_B1):.4g} if the pmap side's is "
            f'{NESTEROV_B1}), or every gradient is scaled by it (a clip by global norm, a loss scale or reduction)'
        )
    if slot == 'nu':
        return (
            f'(1 - b2) differs by that factor, or every gradient by its square root {np.sqrt(abs(c)):.4g} '
            '(a clip by global norm, a loss scale or reduction)'
        )
    return (
        'every gradient is scaled by it (a clip by global norm, a loss scale or reduction); '
        "SGD's momentum does not show in its first trace, which is the gradient"
    )


def _subtrees(slot: str, worst: str, found: clipping.Subtrees) -> Moments:
    """One factor per sub-tree: gradients clipped by norm per sub-tree on one side (the side that holds one norm in
    each sub-tree it clipped) and by the global norm, or not at all, on the other; where neither side holds one norm
    a sub-tree, a scale per sub-tree of another kind gives the same (a loss weight on a term that alone reaches a
    sub-tree, an optimizer setting per sub-tree)."""
    shown = ', '.join(f'{name} {c:.4g}' for name, c in found.factors)
    text = f'the {slot} slots part by one factor per sub-tree, the same over its leaves (new / pmap: {shown}): '
    if found.clipped is None:
        text += ('gradients clipped by norm per sub-tree on one side, by the global norm or not at all on the other, '
                 'a loss weight on a term that alone reaches a sub-tree, or an optimizer setting per sub-tree; '
                 'neither side holds one norm in each sub-tree, and the numbers do not tell which')  # fmt: skip
    else:
        other = 'new' if found.clipped == 'pmap' else 'pmap'
        to = f', to {found.norm / (1 - NESTEROV_B1):.3g} if b1 is {NESTEROV_B1}' if slot == 'mu' else ''
        text += (f"the {found.clipped} side's hold one norm in each sub-tree it clipped, {found.norm:.3g} (its "
                 f"gradients clipped by norm per sub-tree{to}); the {other} side's ")  # fmt: skip
        if found.other_per_subtree:
            text += f'hold one norm a sub-tree too, {found.other:.3g}: clipped per sub-tree, to another norm'
        elif found.global_same:
            text += 'global norm is that norm: clipped by the global norm there'
        else:
            text += f'global norm is {found.other:.3g}: not clipped to that norm there (no clip, or another value)'
    clip = (found.clipped, found.norm, found.other) if found.clipped else None
    return Moments(False, None, worst, text, subtrees=found,
                   read=read(subtrees=tuple(c for _, c in found.factors), clip_norm=clip))  # fmt: skip
