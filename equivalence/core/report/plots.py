"""The figures of ``python -m equivalence.run --plot DIR``: losses, parameter divergence, and, when
the verdict located where the sides part (``verdict.locate``), each module call's difference.

Built on ``matplotlib.figure.Figure`` directly (no pyplot, no global backend switch):
saving a PNG renders with Agg whatever the machine's display.
"""

import os

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from equivalence.core.report.output import atomic_write

FILES = ('losses.png', 'divergence.png', 'location.png')  # location.png: when the verdict located where they part


def losses_figure(legacy_S: np.ndarray, nnx_S: np.ndarray, steps_per_call: int, title: str, first: int = 1) -> Figure:
    """Per-step losses of both paths on one axis, from step ``first``; dotted lines mark the compiled calls."""
    fig = Figure(figsize=(7, 4), dpi=100, layout='constrained')
    ax = fig.add_subplot()
    steps = np.arange(first, first + len(legacy_S))
    ax.plot(steps, legacy_S, 'o-', color='tab:blue', lw=2.5, ms=6, label='legacy pmap(scan), pmean')
    ax.plot(steps, nnx_S, 'x--', color='tab:orange', lw=1.5, ms=7, label='NNX sharded scan, no pmean')
    for boundary in range(first - 1 + steps_per_call, steps[-1], steps_per_call):
        ax.axvline(boundary + 0.5, color='grey', ls=':', lw=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(
        title=title, xlabel=f'training step (dotted: call boundaries, {steps_per_call} steps per call)', ylabel='loss'
    )
    ax.legend()
    return fig


def divergence_figure(
    divergence_C: list[float], steps_per_call: int, atol: float, rtol: float, title: str, first: int = 1
) -> Figure:
    """Max |nnx - legacy| over all parameters after each call, log y, the tolerance as a line.

    An exact zero has no place on a log axis: it is drawn at a floor below everything
    else, with its own marker and legend entry, rather than dropped.
    """
    fig = Figure(figsize=(7, 4), dpi=100, layout='constrained')
    ax = fig.add_subplot()
    d_C = np.asarray(divergence_C, np.float64)
    steps_C = first - 1 + steps_per_call * np.arange(1, len(d_C) + 1)
    positive = d_C[d_C > 0]
    floor = min(positive.min(initial=atol), atol) / 100
    ax.semilogy(steps_C[d_C > 0], positive, 'o-', color='tab:red', label='max |nnx - legacy| over all parameters')
    if (d_C == 0).any():
        zero = d_C == 0
        label = f'exactly 0 (drawn at {floor:.0e})'
        ax.semilogy(steps_C[zero], np.full(zero.sum(), floor), 'v', mfc='none', color='tab:red', label=label)
    ax.axhline(atol, color='black', ls='--', label=f'tolerance: atol {atol:g} (per element: atol + {rtol:g}·|legacy|)')
    ax.set(title=title, xlabel='training steps done (one point per compiled call)', ylabel='max abs difference')
    ax.set_xticks(steps_C)
    ax.set_ylim(floor / 3, max(atol, d_C.max(initial=0.0)) * 10)
    ax.legend(loc='upper left')
    return fig


def location_figure(location, title: str) -> Figure:
    """Per module call of a ``locate.Location`` in the pmap side's order, its output's difference over
    what it was allowed (log scale, 1 drawn as a line; an exact 0 drawn at the bottom with its own
    marker); the first call that parts is marked, and the ``where:`` line's place is said under the title."""
    modules = location.modules
    ratio = np.array([m.ratio for m in modules], np.float64)
    finite = ratio[np.isfinite(ratio) & (ratio > 0)]
    low, high = min(finite.min(initial=1.0), 1.0) / 10, max(finite.max(initial=1.0), 1.0) * 10
    shown, x = np.clip(np.where(ratio > 0, ratio, low), low, high), np.arange(len(modules))
    fig = Figure(figsize=(max(6, 0.3 * len(modules) + 2), 4.5), dpi=100, layout='constrained')
    ax = fig.add_subplot()
    ax.semilogy(x, shown, '-', color='tab:blue', lw=1)
    ax.semilogy(
        x[ratio > 0], shown[ratio > 0], 'o', color='tab:blue', label='max |nnx - legacy| of its output / allowed'
    )
    if (ratio == 0).any():
        ax.semilogy(
            x[ratio == 0], shown[ratio == 0], 'v', mfc='none', color='tab:blue', label=f'exactly equal (at {low:.0e})'
        )
    ax.axhline(1.0, color='black', ls='--', label='allowed: max(10 x twin floor, 8 float32 spacings)')
    if location.first is not None:
        i = location.first
        ax.semilogy(
            [i], [shown[i]], 'o', ms=14, mfc='none', color='tab:red', label=f'first that parts: {modules[i].legacy}'
        )
    ax.set_xticks(x, [m.legacy for m in modules], rotation=60, ha='right', fontsize=7)
    place = f'where: {location.kind}' + (f' at {location.legacy} ↔ {location.new}' if location.legacy else '')
    ax.set(
        title=f'{title}\n{place}',
        ylabel='output difference / allowed',
        xlabel='module calls, in the order they finished (pmap)',
    )
    ax.set_ylim(low / 3, high * 3)
    ax.legend(loc='upper left', fontsize=8)
    return fig


def write(result, directory: str) -> list[str]:
    """The figures of a ``judge.RunResult`` into ``directory`` (created if missing), each written atomically."""
    c, tol = result.config, result.report.tolerance
    os.makedirs(directory, exist_ok=True)
    where = f'{c.workload}, {c.devices} devices'
    first = getattr(result, 'resumed_at', 0) + 1  # NNX resumed from a checkpoint: the steps after it
    figures = {
        'losses.png': losses_figure(
            result.legacy.losses, result.new.losses, c.steps_per_call, f'Per-step loss, both paths ({where})', first
        ),
        'divergence.png': divergence_figure(
            result.param_divergence(), c.steps_per_call, tol.atol, tol.rtol, f'Parameter divergence ({where})', first
        ),
    }
    location = getattr(result.verdict, 'location', None)
    if location is not None and location.modules:
        figures['location.png'] = location_figure(location, f'Where the first step parts ({where})')
    paths = []
    for name, fig in figures.items():
        paths.append(os.path.join(directory, name))
        with atomic_write(paths[-1], binary=True) as f:
            fig.savefig(f, format='png')
    return paths
