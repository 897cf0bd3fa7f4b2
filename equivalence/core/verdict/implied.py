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

import numpy as np

NESTEROV_B1 = 0.9  # Adam's default b1
EXPLAINED = 0.9  # r² a form must reach to be named


def fit(d: np.ndarray, x: np.ndarray) -> tuple[float, float]:
    """``(c, r²)`` of ``d ~ c x`` through 0."""
    if x @ x == 0 or d @ d == 0:
        return 0.0, 0.0
    c = float(d @ x / (x @ x))
    return c, 1 - float((d - c * x) @ (d - c * x) / (d @ d))


def update(p0: np.ndarray, u_old: np.ndarray, u_new: np.ndarray, g: np.ndarray | None, assumed: bool) -> str:
    """What the first updates ``u_old`` (pmap) and ``u_new`` (NNX) from ``p0`` imply, given the pmap
    side's gradient ``g`` (None: not observed; ``assumed``: estimated from Adam's first moment)."""
    live = np.abs(u_old) > 0
    if not live.any():
        return NO_UPDATE
    d = u_new - u_old
    fits = {'lr': fit(d, u_old), 'decay': fit(d, p0)}
    eps = (adam_eps(g, u_old), adam_eps(g, u_new)) if g is not None else (None, None)
    if eps[1] is not None:
        ok = live & (np.abs(g) > 0)
        fits['eps'] = fit(d[ok], u_old[ok] / (np.abs(g[ok]) + eps[1]))
    form, (c, r2) = max(fits.items(), key=lambda kv: kv[1][1])
    if r2 < EXPLAINED:
        ratio = float(np.median(u_new[live] / u_old[live]))
        return f'NNX steps {ratio:.6g} x the pmap side (median), not one step factor, weight decay or eps alone'
    if form == 'lr':
        first = (1 + 2 * NESTEROV_B1) / (1 + NESTEROV_B1)
        text = f'NNX steps {1 + c:.6g} x the pmap side (r² {r2:.3f})'
        if min(abs(1 + c - first), abs(1 / (1 + c) - first)) < 1e-3 * first:
            return text + f', what nesterov gives Adam (b1 {NESTEROV_B1}) on its first step: {first:.4f}'
        return text + ': a learning rate or schedule value that differs by that factor, or a gradient scale'
    if form == 'decay':
        return f'a difference of {c:.3g} x the parameter (r² {r2:.3f}): a decoupled weight decay, lr x (pmap - NNX)'
    how = f', |g| from the first moment with b1 {NESTEROV_B1}' if assumed else ''
    sides = (
        f'about {eps[0]:.2g} on the pmap side, {eps[1]:.2g} in NNX' if eps[0] is not None else f'NNX - pmap {-c:.2g}'
    )
    return f"a difference that grows as |g| shrinks (r² {r2:.3f}): an adaptive optimizer's eps, {sides}{how}"


NO_UPDATE = 'no update on the pmap side (a learning rate of 0 at this step)'


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
