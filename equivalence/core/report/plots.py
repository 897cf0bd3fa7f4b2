"""The figures of ``python -m equivalence.run --plot DIR``: losses, parameter divergence, and, when
the verdict located where the sides part (``verdict.locate``), each module call's difference.

Built on ``matplotlib.figure.Figure`` directly (no pyplot, no global backend switch):
saving a PNG renders with Agg whatever the machine's display.
"""

import os

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from equivalence.core.compare.location import STAGES
from equivalence.core.report.output import atomic_write

FILES = ('losses.png', 'divergence.png', 'location.png')  # location.png: when the verdict looked for where they part


GROUP_COLORS = {'params': 'tab:blue', 'opt_state': 'tab:purple', 'ema': 'tab:green', 'model_state': 'tab:brown',
                'losses': 'tab:orange', 'first_step': 'tab:cyan'}  # fmt: skip
LABELLED = 6  # the failed leaves named on the divergence picture, the worst first


def _on_log(values: np.ndarray, low: float) -> tuple[np.ndarray, np.ndarray]:
    """``values`` for a log axis: an exact 0 (which has no place there) drawn at ``low``; the mask of zeros."""
    values = np.asarray(values, np.float64)
    return np.where(values > 0, values, low), values == 0


def losses_figure(legacy_S, nnx_S, steps_per_call: int, title: str, first: int = 1, leaf=None) -> Figure:
    """Per-step losses of both paths (top), and their difference per step against what the verdict allowed
    the losses (``leaf``: the ``losses`` leaf, its measured floor and limit), log scale (bottom): a gap
    too small to see between two curves is read below. Dotted lines mark the compiled calls."""
    fig = Figure(figsize=(7, 6), dpi=100, layout='constrained')
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1))
    steps = np.arange(first, first + len(legacy_S))
    top.plot(steps, legacy_S, 'o-', color='tab:blue', lw=2.5, ms=6, label='legacy pmap(scan), pmean')
    top.plot(steps, nnx_S, 'x--', color='tab:orange', lw=1.5, ms=7, label='the new side')
    diff = np.abs(np.asarray(nnx_S, np.float64) - np.asarray(legacy_S, np.float64))
    marks = [v for v in (getattr(leaf, 'limit', None), getattr(leaf, 'floor', None)) if v]
    positive = diff[diff > 0]
    low = min(positive.min(initial=1.0), *marks, 1.0) / 100 if positive.size or marks else 1e-9
    shown, zero = _on_log(diff, low)
    bottom.semilogy(steps[~zero], shown[~zero], 'o-', color='tab:red', label='|new - legacy| of the loss')
    if zero.any():
        bottom.semilogy(steps[zero], shown[zero], 'v', mfc='none', color='tab:red', label=f'exactly 0 (at {low:.0e})')
    if leaf is not None and leaf.limit:
        bottom.axhline(leaf.limit, color='black', ls='--', label=f'allowed {leaf.limit:.2e} (from the measured floor)')
    if leaf is not None and leaf.floor:
        bottom.axhline(leaf.floor, color='grey', ls=':', label=f"measured floor {leaf.floor:.2e} (the twin's)")
    for ax in (top, bottom):
        for boundary in range(first - 1 + steps_per_call, steps[-1], steps_per_call):
            ax.axvline(boundary + 0.5, color='grey', ls=':', lw=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
    top.set(title=title, ylabel='loss')
    bottom.set(xlabel=f'training step (dotted: call boundaries, {steps_per_call} steps per call)',
               ylabel='loss difference', ylim=(low / 3, max(shown.max(initial=low), *marks, low) * 10))  # fmt: skip
    return fig


def divergence_figure(divergence_C, steps_per_call: int, leaves, title: str, first: int = 1, screen=None) -> Figure:
    """What the verdict compared, at the end of the run: every leaf's max |new - legacy| against what it was
    allowed (its measured floor's limit, or the fixed screen's where no floor was measured), by group, the
    failed leaves marked and the worst named (right); max |new - legacy| over the parameters after each call
    (left), with the band of the parameters' limits at the end. ``screen``: ``(atol, rtol)``, drawn only
    where a leaf was judged by it."""
    fig = Figure(figsize=(11, 4.5), dpi=100, layout='constrained')
    left, right = fig.subplots(1, 2, width_ratios=(1, 1.3))
    judged = [x for x in leaves if x.limit]  # each judged by its measured floor (NaN or Inf: drawn at the top)
    values = [v for x in judged for v in (x.max_abs, x.limit) if v > 0 and np.isfinite(v)]
    values += [v for v in divergence_C if v > 0]
    low, top = min(values, default=1e-9) / 100, max(values, default=1.0) * 3
    d_C, steps_C = (
        np.asarray(divergence_C, np.float64),
        first - 1 + steps_per_call * np.arange(1, len(divergence_C) + 1),
    )
    shown, zero = _on_log(d_C, low)
    left.semilogy(steps_C[~zero], shown[~zero], 'o-', color='tab:red', label='max |new - legacy| over the parameters')
    if zero.any():
        left.semilogy(steps_C[zero], shown[zero], 'v', mfc='none', color='tab:red', label=f'exactly 0 (at {low:.0e})')
    limits = [x.limit for x in judged if x.group == 'params' and x.limit]
    if limits:
        left.axhspan(min(limits), max(limits), color='tab:blue', alpha=0.15,
                     label=f"the parameters' limits at the end ({min(limits):.1e} to {max(limits):.1e})")  # fmt: skip
    elif screen is not None:
        left.axhline(
            screen[0], color='black', ls='--', label=f'fixed screen: atol {screen[0]:g} + {screen[1]:g}·|legacy|'
        )
    left.set(xlabel='training steps done (one point per compiled call)', ylabel='max abs difference',
             title='after each call', ylim=(low / 3, max(values, default=1.0) * 10))  # fmt: skip
    left.set_xticks(steps_C)
    left.legend(loc='upper left', fontsize=8)
    for group in dict.fromkeys(x.group for x in judged):
        of = [x for x in judged if x.group == group]
        y, _ = _on_log([min(x.max_abs, top) for x in of], low)
        lim = np.array([x.limit for x in of], np.float64)
        ok = np.array([x.ok for x in of])
        color = GROUP_COLORS.get(group, 'tab:gray')
        right.loglog(lim[ok], y[ok], 'o', color=color, alpha=0.7, label=f'{group} ({len(of)})')
        right.loglog(lim[~ok], y[~ok], 'o', color=color, mec='tab:red', mew=2, ms=9)
    noisy = [x for x in judged if x.noise_dominated]
    if noisy:
        right.loglog([x.limit for x in noisy], [min(max(x.max_abs, low), top) for x in noisy], 'x', color='black', ms=9,
                     label=f'noise-dominated ({len(noisy)}): cannot verify')  # fmt: skip
    span = (low, max(values, default=1.0) * 10)
    right.loglog(span, span, '--', color='black', lw=1, label='allowed (above the line: the leaf fails)')
    failed = sorted((x for x in judged if not x.ok), key=lambda x: -(x.max_abs / x.limit if x.limit else np.inf))
    for x in failed[:LABELLED]:
        right.annotate(
            x.name, (x.limit, min(max(x.max_abs, low), top)), fontsize=7, xytext=(4, 4), textcoords='offset points'
        )
    verdict = f'{len(failed)} of {len(judged)} leaves over what they were allowed' if failed else (
        f'all {len(judged)} leaves within what they were allowed')  # fmt: skip
    right.set(xlabel='allowed: max |new - legacy| the verdict accepts', ylabel='max |new - legacy| at the end',
              title=verdict, xlim=span, ylim=span)  # fmt: skip
    right.legend(loc='upper left', fontsize=7)
    fig.suptitle(title)
    return fig


def location_figure(location, title: str) -> Figure:
    """The stage of the first step that parts (``location.kind``'s), marked on the step's stages in order
    (top), the stages before it that the locator found agreeing; and, where module calls were recorded,
    each one's output difference over what it was allowed, in the pmap side's order, the first that
    parts marked (bottom)."""
    modules = location.modules
    fig = Figure(figsize=(max(7, 0.3 * len(modules) + 2), 5.5 if modules else 2.2), dpi=100, layout='constrained')
    axes = fig.subplots(2, 1, height_ratios=(1, 3)) if modules else [fig.subplots()]
    _stage_strip(axes[0], location)
    place = f'where: {location.kind}' + (f' at {location.legacy} ↔ {location.new}' if location.legacy else '')
    axes[0].set_title(f'{title}\n{place}', fontsize=10)
    if modules:
        _module_calls(axes[1], location)
    return fig


def _stage_strip(ax, location) -> None:
    stage = location.kind.stage
    for i, name in enumerate(STAGES):
        if name == stage:
            color, said = 'tab:red', 'parts here'
        elif name in location.agreed:
            color, said = 'tab:green', 'agrees'
        elif name in location.ruled_out:
            color, said = 'palegreen', "ruled out: the run's\nleaves agree"
        else:
            color, said = 'lightgrey', 'not judged'
        ax.barh(0, 1, left=i, color=color, edgecolor='white')
        ax.text(i + 0.5, 0.1, name, ha='center', va='center', fontsize=9, weight='bold' if name == stage else None)
        ax.text(i + 0.5, -0.22, said, ha='center', va='center', fontsize=7)
    ax.set(xlim=(0, len(STAGES)), ylim=(-0.45, 0.45), yticks=[], xticks=[])
    for side in ax.spines.values():
        side.set_visible(False)


def _module_calls(ax, location) -> None:
    modules = location.modules
    ratio = np.array([m.ratio for m in modules], np.float64)
    finite = ratio[np.isfinite(ratio) & (ratio > 0)]
    low, high = min(finite.min(initial=1.0), 1.0) / 10, max(finite.max(initial=1.0), 1.0) * 10
    shown, x = np.clip(np.where(ratio > 0, ratio, low), low, high), np.arange(len(modules))
    ax.semilogy(x, shown, '-', color='tab:blue', lw=1)
    ax.semilogy(
        x[ratio > 0], shown[ratio > 0], 'o', color='tab:blue', label='max |new - legacy| of its output / allowed'
    )
    if (ratio == 0).any():
        ax.semilogy(x[ratio == 0], shown[ratio == 0], 'v', mfc='none', color='tab:blue',
                    label='exactly equal (drawn at the bottom)')  # fmt: skip
    ax.axhline(1.0, color='black', ls='--', label='allowed: max(10 x twin floor, 8 float32 spacings)')
    named = [i for i, m in enumerate(modules) if location.legacy in (m.legacy, m.new)]
    i = location.first if location.first is not None else (named[0] if named else None)
    if i is not None:
        ax.semilogy([i], [shown[i]], 'o', ms=14, mfc='none', color='tab:red', mew=2,
                    label=f'{location.kind} at {modules[i].legacy}')  # fmt: skip
        ax.axvline(i, color='tab:red', lw=0.8, ls=':')
    ax.set_xticks(x, [m.legacy for m in modules], rotation=60, ha='right', fontsize=7)
    ax.set(ylabel='output difference / allowed', xlabel='module calls, in the order they finished (pmap)')
    ax.set_ylim(low / 3, high * 3)
    ax.legend(loc='upper left', fontsize=8)


def write(result, directory: str) -> list[str]:
    """The figures of a ``judge.RunResult`` into ``directory`` (created if missing), each written atomically."""
    c, tol = result.config, result.report.tolerance
    os.makedirs(directory, exist_ok=True)
    where = f'{c.workload}, {c.devices} devices'
    outcome = result.outcome.label
    first = getattr(result, 'resumed_at', 0) + 1  # NNX resumed from a checkpoint: the steps after it
    losses_leaf = next((x for x in result.report.leaves if x.group == 'losses'), None)
    figures = {
        'losses.png': losses_figure(result.legacy.losses, result.new.losses, c.steps_per_call,
                                    f'{outcome}: per-step loss, both paths ({where})', first, leaf=losses_leaf),
        'divergence.png': divergence_figure(result.param_divergence(), c.steps_per_call, result.report.leaves,
                                            f'{outcome}: what the verdict compared ({where})', first,
                                            screen=(tol.atol, tol.rtol)),
    }  # fmt: skip
    location = getattr(result.verdict, 'location', None)
    if location is not None:
        figures['location.png'] = location_figure(location, f'Where the first step parts ({where})')
    paths = []
    for name, fig in figures.items():
        paths.append(os.path.join(directory, name))
        with atomic_write(paths[-1], binary=True) as f:
            fig.savefig(f, format='png')
    return paths
