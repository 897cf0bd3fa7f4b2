"""The update stage of the locator: the first optimizer-state slot that parts after a step (``update``),
what each slot's first-step values imply (``implied.moments``: one factor, a factor per leaf, or uneven:
the gradients differ), and what the update's size implies (``implied.update``).
"""

import dataclasses

import numpy as np

from equivalence.core.compare.location import Location, Unplaced, read, sci
from equivalence.core.locate import implied
from equivalence.core.locate.stages import Step

CLIPPING = 'the gradient clipping'  # the place of a clip that differs: between the gradients and the optimizer
FIRST = ('mu', 'trace')  # a first moment's slot: Adam's (1 - b1) g, SGD momentum's g, after one step from 0


def update(step: Step) -> Location | None:
    """The first slot, or the update rule, that parts after a step; its ``read`` says whether the gradients were
    observed (``gradients``: ``agree`` where the suite computed both sides', ``not observed`` under the port's own
    step, where the first moments stand in for them)."""
    found = _update(step)
    if found is None or found.kind != 'update':
        return found
    seen = read(gradients='agree' if step.grads('legacy') else 'not observed')
    return dataclasses.replace(found, read=found.read + seen)


def _update(step: Step) -> Location | None:
    params, slots = step.held('params'), step.held('opt_state')
    bad_slot = next((leaf for leaf in slots.values() if not leaf.ok), None)
    bad_param = next((leaf for leaf in params.values() if not leaf.ok), None)
    if bad_slot is None and bad_param is None:
        return None
    grads = 'the gradients agree' if step.grads('legacy') else "the gradients are not observed (the port's own step)"
    # the first moments, and the gradients they hold, agree
    said, implies = implied_update(step, bad_slot is None and holds_first_moments(slots, params))
    if bad_param is None and not update_is_zero(step):
        said, implies = '; the parameters after one step agree', ()
    else:
        said = f'; the update implies: {said}'
    # What a slot's values imply assumes its first update from 0 (Adam's mu is (1 - b1) g, SGD's trace is g):
    # on a later step a momentum that differs parts the slots by no one factor, which is not the gradients.
    moments_read = _moments(step, params, slots) if step.step == 1 else {}
    uneven = next(((s, m) for s, m in moments_read.items() if s.rpartition('/')[2] in FIRST and m.factor is None), None)
    if uneven is not None and uneven[1].proportional is not None:  # two places give these numbers: no one place
        return Location(
            'unlocated', '', '',
            f'not located: the forward pass, the loss and the statistics agree, {grads}; {uneven[1].text}; so the '
            'difference is in the training loss (an L2 term) or in the optimizer (a coupled weight decay), which '
            'the first step cannot tell apart',
            why=Unplaced.LOSS_OR_DECAY, read=read(slot=uneven[0]) + uneven[1].read,
        )  # fmt: skip
    clip = uneven is not None and (uneven[1].clipped or (uneven[1].subtrees and uneven[1].subtrees.clipped))
    if clip:  # clipped by value, or by norm per sub-tree on one side: what the optimizer is given, not the gradients
        slot, m = uneven
        return Location(
            'update', CLIPPING, CLIPPING,
            f'the forward pass, the loss and the statistics agree, {grads}; {m.text}', read=read(slot=slot) + m.read,
        )  # fmt: skip
    if uneven is not None and not uneven[1].uneven:  # one factor a leaf: two places give these numbers
        return Location(
            'unlocated', '', '',
            f'not located: the forward pass, the loss and the statistics agree, {grads}; {uneven[1].text}',
            why=Unplaced.ONE_FACTOR, read=read(slot=uneven[0]) + uneven[1].read,
        )  # fmt: skip
    if uneven is not None and uneven[1].uneven:
        slot, m = uneven
        param = m.leaf[len(slot) + 1 :]
        leaf = slots[m.leaf]
        return Location(
            'backward', step.inverse.get(param, param), param,
            f'the forward pass, the loss and the statistics agree, {grads}; {m.text}. The first moment of this '
            f"parameter, opt_state {m.leaf}, is {sci(leaf.max_abs)} apart (allowed {sci(leaf.limit)}); the update's "
            'size is not read (what it implies assumes the same gradients)',
            read=read(slot=slot, leaf=m.leaf, apart=leaf.max_abs, allowed=leaf.limit) + m.read,
        )  # fmt: skip
    if bad_slot is not None:
        param = param_of(bad_slot.path, params)
        slot = bad_slot.path[: -len(param) - 1] if param else bad_slot.path
        unseen = _later_slot(step, slot, slot_names(slots, params).get(slot, []), slots, grads)
        if unseen is not None:
            return unseen
        first = next((m for s, m in moments_read.items() if s.rpartition('/')[2] in FIRST), None)
        read_here = moments_read.get(slot)
        if (
            read_here is not None
            and read_here.even
            and slot.endswith('nu')
            and first is None
            and any(s.rpartition('/')[2] == 'mu' for s in slot_names(slots, params))
        ):
            said = '; the first moments agree, so the gradients do: (1 - b2) differs' + said
        scaled = gradient_scale(slot, read_here, implies)
        if scaled is not None:  # the update's eps-like form and the first moments' factor: one cause gives both
            said = (f'; {read_here.text}; the update implies an eps {scaled:.3g} x smaller in NNX, which every '
                    f'gradient scaled by {scaled:.3g} gives Adam too (its update is unchanged by a gradient scale '
                    'but for its eps), and no eps gives the first moments: every gradient is scaled')  # fmt: skip
            implies = read(update='gradient scale', gradient_factor=scaled)
        elif read_here is not None:
            said = f'; {read_here.text}{said}'
        moments = read_here.read if read_here is not None else ()
        return Location(
            'update', f'opt_state {slot}/{step.inverse.get(param, param)}' if param else f'opt_state {slot}',
            f'opt_state {bad_slot.path}',
            f'the forward pass, the loss and the statistics agree, {grads}; the optimizer slot {slot} is the first '
            f'that parts {step.after} ({sci(bad_slot.max_abs)} apart, allowed {sci(bad_slot.limit)}){said}',
            read=read(slot=slot, leaf=bad_slot.path, apart=bad_slot.max_abs, allowed=bad_slot.limit)
            + moments + implies,
        )  # fmt: skip
    return Location(
        'update', 'the update rule', 'the update rule',
        f'the forward pass, the loss, the statistics and every optimizer slot agree, {grads}; the parameters '
        f'{step.after} do not ({bad_param.path} {sci(bad_param.max_abs)} apart, allowed {sci(bad_param.limit)}){said}',
        read=read(leaf=bad_param.path, apart=bad_param.max_abs, allowed=bad_param.limit) + implies,
    )  # fmt: skip


def gradient_scale(slot: str, moments, implies: tuple) -> float | None:
    """The factor every gradient is scaled by, where a first moment's slot parts by one factor ``c`` on every element
    and the update reads as an adaptive optimizer's eps ``c`` times smaller on the NNX side (within 5%): Adam's update
    ``c m / (c sqrt(v) + eps)`` is ``m / (sqrt(v) + eps / c)``, so a gradient scale gives both, and an eps alone leaves
    the first moments as they are (google/mipnerf's clip by global norm 0.1 for 0.05, tried blind, read 'an adaptive
    optimizer's eps' beside 'the mu slots part by one factor: NNX = 2 x pmap'); None otherwise."""
    said = dict(implies)
    if slot.rpartition('/')[2] not in FIRST or moments is None or moments.factor is None or said.get('update') != 'eps':
        return None
    eps, c = said.get('eps'), float(moments.factor)
    if not eps or min(eps) <= 0 or c <= 0:
        return None
    return c if abs(eps[0] / eps[1] / c - 1) <= 0.05 else None


def param_of(path: str, params: dict) -> str:
    """The parameter an optimizer-state leaf ``path`` (``0/mu/block/fc1/kernel``) holds a slot of ('' none)."""
    return next((p for p in sorted(params, key=len, reverse=True) if path.endswith('/' + p)), '')


def holds_first_moments(slots: dict, params: dict) -> bool:
    """Whether the optimizer state holds a first moment (``FIRST``) of some parameter: the gradients, held."""
    return any(s.rpartition('/')[2] in FIRST for s in slot_names(slots, params))


def slot_names(slots: dict, params: dict) -> dict[str, list[str]]:
    """Slot (``0/mu``) -> its leaves' paths, for every leaf that holds a slot of a parameter."""
    out: dict[str, list[str]] = {}
    for path in slots:
        param = param_of(path, params)
        if param:
            out.setdefault(path[: -len(param) - 1], []).append(path)
    return out


def _moments(step: Step, params: dict, slots: dict) -> dict:
    """Slot -> ``implied.moments`` for each first or second moment (``mu``, ``trace``, ``nu``) that parts."""
    p0 = step.before()
    ends = [step.final(side, 'opt_state') for side in ('legacy', 'new')]
    found_by_slot = {}
    for slot, paths in slot_names(slots, params).items():
        kind = slot.rpartition('/')[2]
        if kind not in (*FIRST, 'nu') or all(slots[p].ok for p in paths):
            continue
        # A slot of a noise-dominated parameter holds reordering only (a bias before a GroupNorm: 1e-20, its
        # ratio anything): it tells no factor, and left in it made score_sde's one factor 'uneven'.
        leaves = {p: (ends[0][p], ends[1][p], slots[p].limit or 0.0) for p in paths
                  if p in ends[0] and p in ends[1] and not slots[p].noise_dominated}  # fmt: skip
        found = implied.moments(kind, leaves, {p: p0[p[len(slot) + 1 :]] for p in paths if p[len(slot) + 1 :] in p0})
        if found is not None:
            found_by_slot[slot] = found
    return found_by_slot


def implied_update(step: Step, moments_agree: bool = False) -> tuple[str, tuple]:
    """``(the sentence, its numbers)``: ``implied.update`` on every parameter both sides hold, and any learning rate
    the state exposes (``moments_agree``: the optimizer's first moments agree on both sides: see ``implied.update``)."""
    start = step.before()
    ends = [step.final(side, 'params') for side in ('legacy', 'new')]
    keys = [k for k in start if all(k in e for e in ends)]
    if not keys:
        return 'nothing (no parameter is held by both sides)', ()
    cat = lambda d: implied.flat(d, keys)  # noqa: E731
    p0, grads, scale = cat(start), step.grads('legacy'), 1.0
    if not grads:  # a loop port: Adam's first moment is (1 - b1) g after one step
        mu = {k: v for k, v in step.final('legacy', 'opt_state').items() if '/mu/' in f'/{k}'}
        grads = {next((k for k in keys if name.endswith('/' + k)), ''): v for name, v in mu.items()}
        scale = 1 - implied.NESTEROV_B1
    g = cat(grads) / scale if all(k in grads for k in keys) else None
    kernels = np.concatenate([np.full(np.size(start[k]), np.ndim(start[k]) >= 2) for k in keys])
    text, implies = implied.update(p0, cat(ends[0]) - p0, cat(ends[1]) - p0, g, scale != 1.0, kernels, step.step,
                                   moments_agree)  # fmt: skip
    rates = [
        {k: v for k, v in step.final(side, 'opt_state').items() if 'learning_rate' in k} for side in ('legacy', 'new')
    ]
    shown = [f'{k} pmap {float(np.ravel(v)[0]):.6g}, NNX {float(np.ravel(rates[1][k])[0]):.6g}'
             for k, v in rates[0].items() if k in rates[1]]  # fmt: skip
    return '; '.join([text, *(['the state holds ' + '; '.join(shown)] if shown else [])]), implies


def update_is_zero(step: Step) -> bool:
    """Whether the pmap side's update moved no parameter both sides hold (a learning rate of 0 at this step)."""
    start = step.before()
    ends = [step.final(side, 'params') for side in ('legacy', 'new')]
    keys = [k for k in start if all(k in e for e in ends)]
    return bool(keys) and all(np.array_equal(np.asarray(ends[0][k]), np.asarray(start[k])) for k in keys)


def _later_slot(step: Step, slot: str, paths: list[str], slots: dict, grads: str) -> Location | None:
    """On a later step, with the gradients not observed, a slot that parts is the optimizer only where its
    numbers say so: SGD momentum's trace parts by ``(m' - m) trace_before`` when the momentum differs, a
    multiple of the slot before the step (r² >= ``implied.EXPLAINED`` over the leaves that part); a gradient
    that differs (an L2 term, a decay added to it: imagenet's penalty was named the trace) parts it
    otherwise. None where the slot is the place; else 'not located' with what was read."""
    if step.step == 1 or step.grads('legacy'):
        return None
    kind, before = slot.rpartition('/')[2], step.prior or {}
    leaves = [p for p in paths if p in before and not slots[p].ok and not slots[p].noise_dominated]
    ends = [step.final(side, 'opt_state') for side in ('legacy', 'new')]
    if kind == 'trace' and leaves and all(p in ends[0] and p in ends[1] for p in leaves):
        c, r2 = implied.fit(implied.flat(ends[1], leaves) - implied.flat(ends[0], leaves), implied.flat(before, leaves))
        if r2 >= implied.EXPLAINED:
            return None
        said = f'its difference is no multiple of the slot before the step ({c:.3g} x it, r² {r2:.2f})'
        figures = (c, r2)
    else:
        said, figures = f'the slot before the step is not at hand to read it by ({kind})', (None, None)
    return Location(
        'unlocated', '', '',
        f'not located: the forward pass, the loss and the statistics agree, {grads}; the optimizer slot {slot} '
        f'is the first that parts {step.after}, and {said}: a gradient that differs (a term of the training loss, '
        'a decay added to the gradient) and an optimizer setting both part it, which this step cannot tell apart',
        why=Unplaced.GRADIENT_OR_SETTING, read=read(slot=slot, before_factor=figures[0], r2=figures[1]),
    )  # fmt: skip
