"""The averages a step keeps, held after it: the running statistics (``statistics``, with the momentum
each side's update of a mean implies) and the EMA (``ema``, with the decay each side's update implies).
"""

import numpy as np

from equivalence.core.compare.location import Location, Unplaced, read, sci
from equivalence.core.locate import implied
from equivalence.core.locate.stages import Step, held, initial_params, worst
from equivalence.core.record import intercept
from equivalence.core.state import convert


def statistics(step: Step) -> Location | None:
    module = lambda path: path.partition('/')[2].rpartition('/')[0]  # noqa: E731 -- batch_stats/bn1/mean -> bn1
    bad = sorted((x for x in step.held('model_state').values() if not x.ok), key=lambda x: step.order(module(x.path)))
    if not bad:
        return None
    leaf, stat = bad[0], bad[0].path.partition('/')[2]
    said, momenta = _momenta(step, module(leaf.path))
    return Location(
        'statistics', step.inverse.get(stat, stat).rpartition('/')[0], module(leaf.path),
        f'the forward pass, the loss and the gradients agree; {leaf.path} after one step is {sci(leaf.max_abs)} '
        f'apart (allowed {sci(leaf.limit)}): its running statistics are updated differently{said}',
        read=read(leaf=leaf.path, apart=leaf.max_abs, allowed=leaf.limit, momentum=momenta),
    )  # fmt: skip


def _momenta(step: Step, module: str) -> tuple[str, tuple | None]:
    """``(the clause, (pmap's, NNX's) or None)``: the momentum of each side's one-step update of ``module``'s
    mean, its batch mean taken from the module's recorded input (features on the last axis); None unread."""
    before = {step.mapping.get(p, p): a for p, a in convert.flatten(step.variables.get('batch_stats', {})).items()}
    source = next((old for old, new in step.paired.items() if new == module), None)
    record = step.raw['new'].get(module)
    if step.step > 1 or f'{module}/mean' not in before or source is None or record is None or not record.values[0][0]:
        return '', None
    said, momenta = [], []
    for side in ('legacy', 'new'):
        x = record.values[0][0][0]
        x = intercept.value(step.raw['legacy'][source], 0, 0, x) if side == 'legacy' else x
        mean = np.asarray(x, np.float64).reshape(-1, x.shape[-1]).mean(axis=0)
        m = implied.momentum(
            before[f'{module}/mean'], step.final(side, 'model_state')[f'batch_stats/{module}/mean'], mean
        )
        said.append(f'{side} {m:.4g}' if m is not None else f'{side} -')
        momenta.append(m)
    return f'; the momentum its one-step update of the mean implies: {", ".join(said)}', tuple(momenta)


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
    read = _fits(step)
    carried = _carried(step, bad, read)
    said = f"; the decay each side's update implies: {_decays(read, own=not carried)}" if read else ''
    grads = 'the gradients, ' if step.grads('legacy') else ''
    if carried:  # one decay, and the EMA parts by what the parameters do: the place is before the EMA
        return Location(
            'unlocated', '', '',
            f'not located: only the EMA parts beyond its floor {step.after} (ema/{leaf.path} {sci(leaf.max_abs)} '
            f'apart, allowed {sci(leaf.limit)}){said}; {carried}: the parameters part as well, within their own '
            'floors (noise-dominated here), so the difference comes before the EMA (the update, its optimizer or '
            'its gradients), which these floors cannot place',
            why=Unplaced.BEFORE_EMA,
        )  # fmt: skip
    return Location(
        'ema', 'the EMA', 'the EMA',
        f'the forward pass, the loss, {grads}the parameters and the optimizer state agree {step.after}; '
        f'the EMA does not (ema/{leaf.path} {sci(leaf.max_abs)} apart, allowed {sci(leaf.limit)}): its update '
        f'differs{said}',
    )  # fmt: skip


def _fits(step: Step) -> list[float] | None:
    """The decay each side's update implies (pmap, new), where the EMA before the step is known; else None."""
    before = step.before()
    if step.step > 1 and step.start is not None:
        first = initial_params(step.variables, step.mapping)
        if any(not np.array_equal(step.start[k], first[k]) for k in first if k in step.start):
            return None  # the EMA before this step is not known here
        before = first
    found = []
    for side in ('legacy', 'new'):
        ema_, params = step.final(side, 'ema'), step.final(side, 'params')
        keys = [k for k in ema_ if k in params and k in before]
        if not keys:
            return None
        x, y = (
            implied.flat(before, keys) - implied.flat(params, keys),
            implied.flat(ema_, keys) - implied.flat(params, keys),
        )
        d, r2 = implied.fit(y, x)
        if r2 < 0.99:
            return None
        found.append(d)
    return found


def _same(read: list[float]) -> bool:
    """Whether both sides' decays are one, to the digits said."""
    return f'{read[0]:.6g}' == f'{read[1]:.6g}'


def _decays(read: list[float], own: bool) -> str:
    """Both decays, said; ``own``: the EMA parts by its own arithmetic, where the decays are one."""
    why = ': the arithmetic of the update differs, its precision or order' if own else ''
    return f'pmap {read[0]:.6g}, new {read[1]:.6g}' + (f' (the same decay{why})' if _same(read) else '')


def _carried(step: Step, bad: list, read: list[float] | None) -> str:
    """'' where the EMA's own update parts; else what shows it follows parameters that part. With one decay
    d read on both sides, the EMA parts by ``(1 - d)`` times what the parameters part, and by nothing of its
    own (within each leaf's allowed difference): score_sde's Adam eps, b1 and clip were named 'the EMA'
    where its parameters, noise-dominated, parted within their floors. Where no decay is read, parameters
    that part at all make the EMA's own share unknown."""
    legacy, new = step.final('legacy', 'params'), step.final('new', 'params')
    moved = {leaf.path: np.asarray(new[leaf.path], np.float64) - np.asarray(legacy[leaf.path], np.float64)
             for leaf in bad if leaf.path in legacy and leaf.path in new}  # fmt: skip
    if len(moved) < len(bad) or not any(np.any(v != 0) for v in moved.values()):
        return ''  # parameters that agree to the bit: the EMA's update is the one place left
    if read is None:
        return 'no decay can be read here'
    if not _same(read):
        return ''
    ends = step.final('legacy', 'ema'), step.final('new', 'ema')
    for leaf in bad:
        own = np.asarray(ends[1][leaf.path], np.float64) - np.asarray(ends[0][leaf.path], np.float64)
        if np.max(np.abs(own - (1 - read[0]) * moved[leaf.path]), initial=0) > (leaf.limit or 0.0):
            return ''  # more than the parameters carry: the EMA's own arithmetic (a rate in another precision)
    return f'each EMA leaf parts by (1 - {read[0]:.6g}) x what its parameter parts, and by nothing of its own'
