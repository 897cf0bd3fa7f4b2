"""The averages a step keeps, held after it: the running statistics (``statistics``, with the momentum
each side's update of a mean implies) and the EMA (``ema``, with the decay each side's update implies).
"""

import numpy as np

from equivalence.core.port import convert
from equivalence.core.verdict import implied, intercept
from equivalence.core.verdict.location import Location, sci
from equivalence.core.verdict.stages import Step, held, initial_params, worst


def statistics(step: Step) -> Location | None:
    module = lambda path: path.partition('/')[2].rpartition('/')[0]  # noqa: E731 -- batch_stats/bn1/mean -> bn1
    bad = sorted((x for x in step.held('model_state').values() if not x.ok), key=lambda x: step.order(module(x.path)))
    if not bad:
        return None
    leaf, stat = bad[0], bad[0].path.partition('/')[2]
    return Location(
        'statistics', step.inverse.get(stat, stat).rpartition('/')[0], module(leaf.path),
        f'the forward pass, the loss and the gradients agree; {leaf.path} after one step is {sci(leaf.max_abs)} '
        f'apart (allowed {sci(leaf.limit)}): its running statistics are updated differently'
        + _momenta(step, module(leaf.path)),
    )  # fmt: skip


def _momenta(step: Step, module: str) -> str:
    """The momentum of each side's one-step update of ``module``'s mean, its batch mean taken from
    the module's recorded input (features on the last axis)."""
    before = {step.mapping.get(p, p): a for p, a in convert.flatten(step.variables.get('batch_stats', {})).items()}
    source = next((old for old, new in step.paired.items() if new == module), None)
    record = step.raw['new'].get(module)
    if step.step > 1 or f'{module}/mean' not in before or source is None or record is None or not record.values[0][0]:
        return ''
    said = []
    for side in ('legacy', 'new'):
        x = record.values[0][0][0]
        x = intercept.value(step.raw['legacy'][source], 0, 0, x) if side == 'legacy' else x
        mean = np.asarray(x, np.float64).reshape(-1, x.shape[-1]).mean(axis=0)
        m = implied.momentum(
            before[f'{module}/mean'], step.final(side, 'model_state')[f'batch_stats/{module}/mean'], mean
        )
        said.append(f'{side} {m:.4g}' if m is not None else f'{side} -')
    return f'; the momentum its one-step update of the mean implies: {", ".join(said)}'


def ema(step: Step) -> Location | None:
    """The EMA, where the parameters and the optimizer state agree after the step and it does not: its
    update differs (the decay, the leaves it follows, the precision of its arithmetic). The decay each
    side's update implies is read where the EMA before the step is known: the parameters before it,
    on step 1, or on a later step that followed only updates of 0 (a warmup from 0), for an EMA that
    starts as the parameters (as score_sde's and flax's do): ``ema = d ema_before + (1 - d) params``."""
    # The EMA is the parameters' own arithmetic, no sum of gradients: held to its floor alone (not to its
    # module's scale), the parameters the verdict found noise-dominated left out.
    apart = held(step.final('legacy', 'ema'), step.final('new', 'ema'), step.final('twin', 'ema'), noisy=step.noisy)
    bad = [leaf for leaf in apart.values() if not leaf.ok]
    if not bad:
        return None
    leaf = worst(bad)
    decays = _decays(step)
    said = f"; the decay each side's update implies: {decays}" if decays else ''
    grads = 'the gradients, ' if step.grads('legacy') else ''
    return Location(
        'ema', 'the EMA', 'the EMA',
        f'the forward pass, the loss, {grads}the parameters and the optimizer state agree {step.after}; '
        f'the EMA does not (ema/{leaf.path} {sci(leaf.max_abs)} apart, allowed {sci(leaf.limit)}): its update '
        f'differs{said}',
    )  # fmt: skip


def _decays(step: Step) -> str:
    before = step.before()
    if step.step > 1 and step.start is not None:
        first = initial_params(step.variables, step.mapping)
        if any(not np.array_equal(step.start[k], first[k]) for k in first if k in step.start):
            return ''  # the EMA before this step is not known here
        before = first
    said = []
    for side in ('legacy', 'new'):
        ema_, params = step.final(side, 'ema'), step.final(side, 'params')
        keys = [k for k in ema_ if k in params and k in before]
        if not keys:
            return ''
        cat = lambda d, keys=keys: np.concatenate([np.asarray(d[k], np.float64).ravel() for k in keys])  # noqa: E731
        x, y = cat(before) - cat(params), cat(ema_) - cat(params)
        d, r2 = implied.fit(y, x)
        if r2 < 0.99:
            return ''
        said.append(f'{"pmap" if side == "legacy" else "new"} {d:.6g}')
    same = said[0].split()[1] == said[1].split()[1]
    return ', '.join(said) + (' (the same decay: the arithmetic of the update differs, its precision or order)'
                              if same else '')  # fmt: skip
