"""The forward stage of the locator (``forward``): the first module call of the first step whose input or
output parts beyond its floor, in the order the pmap side's calls finished: the code that feeds it
(``between``), the module itself (``module``), or a Dropout's draw (``randomness``); before any of them,
the step's own random draws, where the two sides draw otherwise (``draws_differ``); and not located where
a value parts example by example (``by_example``).
"""

import numpy as np

from equivalence.core.compare.location import ROOT, Location, Module, Unplaced, read, sci
from equivalence.core.locate.stages import Step
from equivalence.core.record import pairing

BETWEEN = 'the code between them (an activation, a residual, a mask)'


DRAWS = "the step's own random draws"


def forward(step: Step) -> Location | None:
    drawn = draws_differ(step)
    if drawn is not None:
        return drawn
    for i, m in enumerate(step.modules):
        if not m.input_ok:
            if _measured(m.input_diff):
                return _fed(step, i, m)
            if not outermost_unseen(m):
                return _uncompared(m, 'inputs')
        if not m.output_ok:
            if _measured(m.output_diff):
                return _parted(step, i, m)
            if not outermost_unseen(m):
                return _uncompared(m, 'outputs')
    return None


def _measured(x) -> bool:
    return x is not None and bool(np.isfinite(x))


def outermost_unseen(m: Module) -> bool:
    """Whether ``m`` is the outermost call on a side whose arrays do not compare and of which nothing measured
    parts: what it computes past its inner calls is read by the loss, which then names no place where it parts
    (``stages._loss_location``), and the stages after the loss still run. Hugging Face's Flax GPT-2, tried blind,
    takes its masks and position ids and returns a tuple of hidden states, its head applied outside it, where an
    NNX port takes the tokens and returns the logits: a correct port, and its optimizer slips, were not located."""
    return ROOT in (m.legacy, m.new) and not (_measured(m.output_diff) and not m.output_ok)


def _uncompared(m: Module, what: str) -> Location:
    """The first call that fails has no figure: its two sides' arrays differ in shape or number, as where
    the calls pair one to one no longer (a module called on one side only: google-research/vision_transformer's
    attention dropout left out, tried blind, paired linen's Dropout_0 with the MLP's dropout and was named
    'between', its difference '-'). No place is named without a figure."""
    return Location(
        'unlocated', '', '',
        f'not located: every call before it agrees; the {what} of {m.legacy} ↔ {m.new} cannot be compared (arrays '
        'of other shapes or in another number): from here the two sides\' module calls may not pair one to one, as '
        'where a module is called on one side only (the calls not paired are listed below)',
        why=Unplaced.UNCOMPARED, read=read(legacy_call=m.legacy, new_call=m.new, arrays=what),
    )  # fmt: skip


def draws_differ(step: Step) -> Location | None:
    """The two steps' own random draws (``draws.own``: by the shape drawn and the key drawn from, the dropout
    bridge's masks left out), where they differ: what follows them parts because of them, so no module is
    the place (google-research/vdm's step key ``fold_in(rng, step + 1)``, tried blind, was 'between at
    gamma#1 → gamma#2', the input of gamma#2 being the times drawn from it)."""
    a, b = ((step.results.get(side) or step.results['new']).draws for side in ('legacy', 'new'))
    if a is None or b is None or a == b:
        return None
    only = sorted(a - b) or sorted(b - a)
    return Location(
        'randomness', DRAWS, DRAWS,
        f'{len(a - b)} of the {len(a)} random draws of the pmap step (each by the count of numbers drawn and the '
        f"key drawn from) are not the new step's, which makes {len(b - a)} of its {len(b)} otherwise (one of "
        f'{only[0][0][0]} numbers): a key derived otherwise (a split, a fold_in, a step count, per device or '
        'global) or a draw of another size; what parts after them in the forward pass follows from them',
        read=read(differ=len(a - b), draws=len(a)),
    )  # fmt: skip


def _fed(step: Step, i: int, m: Module) -> Location:
    """Module call ``m``'s input parts while every call before it agrees: the code that feeds it; but where
    some examples of that input agree and others part, not located (``by_example``)."""
    before = step.modules[i - 1] if i else None
    rows = by_example(step, m)
    if rows is not None:
        agree, n, moved = rows
        said = (f"each device's rows of its {n} examples are, whole, a device's rows of the other side ({agree} "
                'in their place)' if moved else f'{agree} of its {n} examples agree')  # fmt: skip
        return Location(
            'unlocated', '', '',
            f'not located: everything before agrees; the input of {m.legacy} is {sci(m.input_diff)} apart (allowed '
            f'{sci(m.input_allowed)}), but {said}: it parts example by example, as where '
            "the examples are laid out over the devices otherwise (which device's rows and keys each example gets) "
            'or where code treats examples apart (a mask), which the first step cannot tell apart',
            why=Unplaced.BY_EXAMPLE,
        )  # fmt: skip
    attention = next((c for c in step.modules if m.legacy.startswith(c.legacy + '/') and 'Attention' in c.cls), None)
    what = 'an activation, a residual, a mask'
    if attention is not None:
        what = f'inside {attention.legacy}: the attention weights (scale, mask, softmax, dropout)'
        what += settings_differ(step, attention).replace('; its settings', f"; {attention.legacy}'s settings", 1)
    # the call before is the one before in the order the calls finished, not what feeds this one: no data flow is
    # observed (google/mipnerf's level 1, tried blind, is fed by level 0's density head; the call before: its rgb head)
    code = f'the code between {before.legacy} (the call before) and {m.legacy}' if before else 'the code that feeds it'
    return Location(
        'between',
        f'{before.legacy if before else "(the inputs)"} → {m.legacy}',
        f'{before.new if before else "(the inputs)"} → {m.new}',
        f'everything before agrees; the input of {m.legacy} is {sci(m.input_diff)} apart (allowed '
        f'{sci(m.input_allowed)}): {code} differs ({what})',
        first=i, read=read(before=before.legacy if before else None, call=m.legacy, apart=m.input_diff,
                           allowed=m.input_allowed),
    )  # fmt: skip


def by_example(step: Step, m: Module) -> tuple[int, int, bool] | None:
    """``(examples that agree, examples, whether each device's rows are another device's)`` of the input of ``m``
    that parts most, where some of its examples (its leading axis) agree within what it is allowed and others
    part, or where every device's rows are, whole, another device's (``_elsewhere``); None otherwise. A code path
    that differs changes every example it computes (google-research/vdm's Fourier features: 0 of 8 agree); the
    examples laid out over the devices otherwise (device d given examples d, d + D, ...: tried blind, it was
    'between at dense1 → conv_in') leave the ones that keep their place (2 of 8); a new step's loop over the
    groups of rows in another order than the devices' leaves none in place."""
    label = '' if m.legacy == ROOT else m.legacy
    if label not in step.paired or m.input_allowed is None:
        return None
    ref, other, _ = pairing.trees(step.raw, {label: step.paired[label]})
    per_device = step.raw['legacy'][label].values[0][0]  # device 0's inputs on the pmap side: its rows
    devices = len(step.raw['legacy'][label].values)
    found = []
    for i, key in ((int(k.rpartition('/')[2]), k) for k in other if '/in/' in k and k in ref):
        a, b = (np.asarray(x, np.float64) for x in (ref[key], other[key]))
        if a.shape != b.shape or a.ndim < 1 or a.shape[0] < 2 or not np.issubdtype(a.dtype, np.floating):
            continue
        if a.ndim > 1 and i < len(per_device) and np.shape(per_device[i]) == a.shape[1:]:
            a, b = (x.reshape(-1, *x.shape[2:]) for x in (a, b))  # [D, B / D, ...] (a vmapped forward): by example
        apart = np.abs(a - b).reshape(a.shape[0], -1).max(axis=1, initial=0.0)
        if apart.max() > m.input_allowed:
            moved = _elsewhere(a, b, devices, m.input_allowed)
            found.append((float(apart.max()), int((apart <= m.input_allowed).sum()), a.shape[0], moved))
    if not found:
        return None
    _, agree, n, moved = max(found)
    return (agree, n, moved) if 0 < agree < n or (moved and agree < n) else None


def _elsewhere(a: np.ndarray, b: np.ndarray, devices: int, allowed: float) -> bool:
    """Whether each device's rows of ``b`` are, within ``allowed``, some device's rows of ``a``: the same examples
    laid out over the devices in another order (a new step's loop over the groups of rows in another order than
    the devices'), where no example need agree in its place."""
    if devices < 2 or a.shape[0] % devices:
        return False
    a_, b_ = (x.reshape(devices, -1) for x in (a, b))
    apart = np.abs(b_[:, None, :] - a_[None, :, :]).max(axis=2, initial=0.0)  # [b's device, a's device]
    return bool((apart <= allowed).any(axis=1).all())


def differing(step: Step, m: Module) -> tuple[tuple[str, object, object], ...]:
    """The scalar settings the two sides' calls ``m`` hold under one name with other values, as
    ``(name, legacy's, the new side's)``: ``(('epsilon', 1e-06, 1e-05),)``; () none."""
    legacy_label = '' if m.legacy == ROOT else m.legacy
    nnx_label = step.paired.get(legacy_label, '')
    records = [step.raw.get('legacy', {}).get(legacy_label), step.raw.get('new', {}).get(nnx_label)]
    if records[0] is None or records[1] is None:
        return ()
    a, b = (dict(r.settings) for r in records)
    return tuple((k, a[k], b[k]) for k in sorted(a.keys() & b.keys()) if a[k] != b[k])


def settings_differ(step: Step, m: Module) -> str:
    """``differing`` in the location's figures ('' none): ``; its settings differ: epsilon 1e-06 ↔ 1e-05``."""
    differ = [f'{k} {a!r} ↔ {b!r}' for k, a, b in differing(step, m)]
    return f'; its settings differ: {", ".join(differ)}' if differ else ''


def _parted(step: Step, i: int, m: Module) -> Location:
    """Module call ``m``, whose inputs agree, computes another output."""
    apart = f'its output {sci(m.output_diff)} apart (allowed {sci(m.output_allowed)}, floor {sci(m.output_floor)})'
    inputs = f'its inputs agree ({sci(m.input_diff)} apart, allowed {sci(m.input_allowed)})'
    inside = [c for c in step.modules[:i] if m.legacy == ROOT or c.legacy.startswith(m.legacy + '/')]
    said = settings_differ(step, m)
    if 'Dropout' in m.cls:
        bridged = any(r.cls == 'ToNNX' for r in step.raw.get('new', {}).values())
        rule = (
            (
                "; the new side's linen runs inside nnx.bridge.ToNNX, which hands linen fold_in(key, count) of each "
                'stream, not the key the pmap step gives apply(rngs=...) (docs/ladder.md, the bridge rung: hand it '
                'the key itself)'
            )
            if bridged
            else ''
        )
        return Location(
            'randomness', m.legacy, m.new, f'{inputs}, {apart}: the two sides draw other masks{said}{rule}', first=i,
            settings=differing(step, m),
        )  # fmt: skip
    if inside:
        what = 'the attention weights (scale, mask, softmax, dropout)' if 'Attention' in m.cls else BETWEEN
        return Location(
            'between', f'{m.legacy} (inside)', f'{m.new} (inside)',
            f'{inputs} and its {len(inside)} submodule call(s) agree, {apart}: {what}{said}', first=i,
            settings=differing(step, m), read=read(inside=m.legacy, apart=m.output_diff, allowed=m.output_allowed),
        )  # fmt: skip
    return Location('module', m.legacy, m.new, f'{inputs}, {apart}: it computes something else{said}', first=i,
                    settings=differing(step, m))  # fmt: skip
