"""Where the two sides part: the first module, loss, gradient, statistic or optimizer slot whose
first-step value leaves its own measured floor (issue 27).

The first step is run once more on each side and on the NNX twin, every module call recorded
(``intercept``). Modules are paired through the port's ``names`` (``pairing``): a linen module with
the NNX module that holds what it holds; one without variables by the same renaming of its path; a
Dropout by its place among the Dropout calls, which is how the randomness bridge keys its masks.
Every value is held to the verdict's rule (``compare.compare_to_floor``, ``MEASURED_FLOOR``:
``max(10 x |nnx - twin|, 8 float32 spacings)``), and the first place that parts, in this order, is
named (``Location``):

1. forward, in the order the pmap side's module calls finished: the first call whose input or
   output parts. An input that parts while everything before agrees is the code that feeds it
   (``between``: an activation, a residual, a mask between two modules); an output that parts
   while its inputs agree is that module (``module``), or the code between its submodules when it
   holds some and they all agree (``between``), or, for a Dropout, its draw (``randomness``);
2. the loss (``loss``): every module agrees and the loss does not;
3. the backward pass (``backward``, model ports): the first parameter, from the output back, whose
   gradient parts;
4. running statistics (``statistics``): the module whose statistics part, and the momentum each
   side's one-step update implies;
5. the update (``update``): the first optimizer-state slot that parts, and what the update's size
   implies (``implied``);
6. ``none``: nothing parts on the first step; ``unlocated``: it was not run or not observable, and why.

It runs on MISMATCH, and on MATCH when ``RunConfig.locate`` asks (``attach``, called by ``judge``).
"""

import dataclasses

import jax
import numpy as np

from equivalence.core.port import convert
from equivalence.core.port.config import RunConfig
from equivalence.core.port.kind import Kind
from equivalence.core.run import setups
from equivalence.core.verdict import compare, implied, intercept, pairing, probe, twin
from equivalence.core.verdict.intercept import DOUT, LOSS, NOT_MODULES
from equivalence.core.verdict.pairing import pairs, recorded_grads
from equivalence.core.verdict.rule import MEASURED_FLOOR

ROOT = '(the model)'  # how the outermost module call is shown
BETWEEN = 'the code between them (an activation, a residual, a mask)'
WARMUP = 'the first update is 0'  # what a 'none' at step 1 says under a warmup from 0


@dataclasses.dataclass(frozen=True)
class Module:
    """One paired module call, in the order the pmap side's calls finished."""

    legacy: str
    nnx: str
    cls: str
    input_diff: float  # max |nnx - legacy| over its array inputs (the worst against what it was allowed)
    input_allowed: float | None
    input_ok: bool
    output_diff: float  # ... over its outputs
    output_allowed: float | None
    output_floor: float | None
    output_ok: bool

    @property
    def ratio(self) -> float:
        """Output difference over what it was allowed (> 1: it parts)."""
        return _over(self.output_diff, self.output_allowed)


@dataclasses.dataclass(frozen=True)
class Location:
    """Where the first step parts: ``kind`` (module, between, randomness, loss, backward, statistics,
    update, none, unlocated), the linen and NNX places, and the figures that say so."""

    kind: str
    legacy: str
    nnx: str
    figures: str
    modules: tuple[Module, ...] = ()
    first: int | None = None  # the index in ``modules`` of the first call that parts
    notes: tuple[str, ...] = ()  # what was not paired or not observed, and why

    def line(self) -> str:
        if self.kind in ('none', 'unlocated'):
            return f'where: {self.kind}: {self.figures}'
        return f'where: {self.kind} at {self.legacy} ↔ {self.nnx}: {self.figures}'

    def lines(self) -> list[str]:
        return [self.line(), *(f'  {note}' for note in self.notes)]

    def to_json(self) -> dict:
        return {
            'kind': self.kind,
            'legacy': self.legacy,
            'nnx': self.nnx,
            'figures': self.figures,
            'first_module': self.first,
            'notes': list(self.notes),
            'modules': [dataclasses.asdict(m) for m in self.modules],
        }


def _over(diff: float, allowed: float | None) -> float:
    if allowed is None or not np.isfinite(diff):
        return np.inf
    return diff / allowed if allowed > 0 else (np.inf if diff > 0 else 0.0)


def _e(x: float | None) -> str:
    return '-' if x is None or not np.isfinite(x) else f'{x:.2e}'


# -- the stages --------------------------------------------------------------------------------


def _held(ref: dict, other: dict, twin_: dict) -> dict[str, compare.LeafDiff]:
    """Every leaf held to its floor (``twin_`` missing a leaf: floor 0), by path."""
    report = compare.compare_to_floor({'g': ref}, {'g': other}, {'g': twin_}, MEASURED_FLOOR)
    return {leaf.path: leaf for leaf in report.leaves}


def _worst(leaves: list) -> compare.LeafDiff | None:
    return max(leaves, key=lambda leaf: _over(leaf.max_abs, leaf.limit), default=None)


def _modules(raw: dict, paired: dict[str, str]) -> list[Module]:
    by = _held(*pairing.trees(raw, paired))
    out = []
    for old in sorted(paired, key=lambda label: raw['legacy'][label].order):
        new = paired[old]
        ins = _worst([leaf for path, leaf in by.items() if path.startswith(f'{new}/in/')])
        outs = _worst([leaf for path, leaf in by.items() if path.startswith(f'{new}/out/')])
        out.append(Module(
            old or ROOT, new or ROOT, raw['legacy'][old].cls,
            ins.max_abs if ins else 0.0, ins.limit if ins else None, ins is None or ins.ok,
            outs.max_abs if outs else 0.0, outs.limit if outs else None, outs.floor if outs else None,
            outs is None or outs.ok,
        ))  # fmt: skip
    return out


@dataclasses.dataclass
class _Step:
    """The three first steps, and what the stages read of them."""

    port_kind: Kind
    results: dict  # side -> sides.PathResult after one step
    raw: dict  # side -> label -> intercept.Record
    mapping: dict[str, str]  # linen leaf path -> NNX leaf path
    variables: dict
    modules: list[Module]
    paired: dict[str, str]
    step: int = 1  # the step judged (a later one: nothing parted before it)
    start: dict | None = None  # the pmap side's parameters before the judged step (NNX paths); None: step 1's

    def before(self) -> dict[str, np.ndarray]:
        """The parameters before the judged step, by NNX path."""
        return self.start if self.start is not None else _initial(self.variables, self.mapping)

    @property
    def after(self) -> str:
        return 'after one step' if self.step == 1 else f'after step {self.step}'

    @property
    def inverse(self) -> dict[str, str]:
        return {new: old for old, new in self.mapping.items()}

    def final(self, side: str, group: str) -> dict:
        result = self.results.get(side) or self.results['nnx']
        return result.final.get(group) or {}

    def held(self, group: str) -> dict[str, compare.LeafDiff]:
        return _held(self.final('legacy', group), self.final('nnx', group), self.final('twin', group))

    def order(self, path: str) -> int:
        """When NNX module ``path``, or the one holding it, finished its first call (last when none)."""
        done = {label: r.order for label, r in self.raw.get('nnx', {}).items() if '#' not in label}
        owners = [p for p in done if p not in NOT_MODULES and (not p or path == p or path.startswith(p + '/'))]
        return done[max(owners, key=len)] if owners else 1 << 30

    def grads(self, side: str) -> dict[str, np.ndarray]:
        return recorded_grads(self.raw, side, self.mapping)


def _forward(step: _Step) -> Location | None:
    for i, m in enumerate(step.modules):
        if not m.input_ok:
            return _fed(step, i, m)
        if not m.output_ok:
            return _parted(step, i, m)
    return None


def _fed(step: _Step, i: int, m: Module) -> Location:
    """Module call ``m``'s input parts while every call before it agrees: the code that feeds it."""
    before = step.modules[i - 1] if i else None
    attention = next((c for c in step.modules if m.legacy.startswith(c.legacy + '/') and 'Attention' in c.cls), None)
    what = 'an activation, a residual, a mask'
    if attention is not None:
        what = f'inside {attention.legacy}: the attention weights (scale, mask, softmax, dropout)'
        what += _settings(step, attention).replace('; its settings', f"; {attention.legacy}'s settings", 1)
    return Location(
        'between',
        f'{before.legacy if before else "(the inputs)"} → {m.legacy}',
        f'{before.nnx if before else "(the inputs)"} → {m.nnx}',
        f'everything before agrees; the input of {m.legacy} is {_e(m.input_diff)} apart (allowed '
        f'{_e(m.input_allowed)}): the code{f" after {before.legacy}" if before else ""} that feeds it differs ({what})',
        first=i,
    )


def _settings(step: _Step, m: Module) -> str:
    """The scalar settings the two sides' calls ``m`` hold under one name with other values ('' none):
    ``; its settings differ: epsilon 1e-06 ↔ 1e-05``."""
    legacy_label = '' if m.legacy == ROOT else m.legacy
    nnx_label = step.paired.get(legacy_label, '')
    records = [step.raw.get('legacy', {}).get(legacy_label), step.raw.get('nnx', {}).get(nnx_label)]
    if records[0] is None or records[1] is None:
        return ''
    a, b = (dict(r.settings) for r in records)
    differ = [f'{k} {a[k]!r} ↔ {b[k]!r}' for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]
    return f'; its settings differ: {", ".join(differ)}' if differ else ''


def _parted(step: _Step, i: int, m: Module) -> Location:
    """Module call ``m``, whose inputs agree, computes another output."""
    apart = f'its output {_e(m.output_diff)} apart (allowed {_e(m.output_allowed)}, floor {_e(m.output_floor)})'
    inputs = f'its inputs agree ({_e(m.input_diff)} apart, allowed {_e(m.input_allowed)})'
    inside = [c for c in step.modules[:i] if m.legacy == ROOT or c.legacy.startswith(m.legacy + '/')]
    said = _settings(step, m)
    if 'Dropout' in m.cls:
        return Location(
            'randomness', m.legacy, m.nnx, f'{inputs}, {apart}: the two sides draw other masks{said}', first=i
        )
    if inside:
        what = 'the attention weights (scale, mask, softmax, dropout)' if 'Attention' in m.cls else BETWEEN
        return Location(
            'between', f'{m.legacy} (inside)', f'{m.nnx} (inside)',
            f'{inputs} and its {len(inside)} submodule call(s) agree, {apart}: {what}{said}', first=i,
        )  # fmt: skip
    return Location('module', m.legacy, m.nnx, f'{inputs}, {apart}: it computes something else{said}', first=i)


def _loss(step: _Step) -> Location | None:
    sides = ('legacy', 'nnx', 'twin')
    trees = [{'mean': np.float32((step.results.get(s) or step.results['nnx']).losses[-1])} for s in sides]
    records = [step.raw.get(s, {}).get(LOSS) for s in sides]
    if records[0] is not None and records[1] is not None:
        like = records[1].values[0][1][0]
        for tree, record in zip(trees, records, strict=True):
            tree['per-example'] = like if record is None else intercept.value(record, 0, 1, like)
    leaf = _worst([leaf for leaf in _held(*trees).values() if not leaf.ok])
    if leaf is None:
        return _output_grad(step)
    return _loss_location(
        step,
        f'the {leaf.path} loss is {_e(leaf.max_abs)} apart (allowed {_e(leaf.limit)}): '
        'the loss function differs (label smoothing, weights, reduction, masking)',
    )


def _loss_location(step: _Step, figures: str) -> Location:
    """A ``loss`` location: the two sides' loss functions, and whether the model's output agrees first."""
    root = next((m for m in step.modules if m.legacy == ROOT), None)
    model = f"the model's output agrees ({_e(root.output_diff)} apart); " if root is not None else ''
    names = step.port_kind.loss_names()
    return Location('loss', names[0], names[1], model + figures)


def _output_grad(step: _Step) -> Location | None:
    """The training loss's gradient with respect to the model's output (``DOUT``), where the forward pass
    agrees: it parts when the step trains on another loss than the other side's, reported or not (a loop
    port's reported loss may leave out the label smoothing it trains with). One factor between the sides
    is taken out first: the reduction (a mean per device, then pmean, against one global mean) scales it."""
    records = [step.raw.get(side, {}).get(DOUT) for side in ('legacy', 'nnx', 'twin')]
    if records[0] is None or records[1] is None:
        return None
    new = intercept.value(records[1], 0, 1)
    old = intercept.value(records[0], 0, 1, new)
    twin_ = intercept.value(records[2], 0, 1, new) if records[2] is not None else new
    if old.shape != new.shape or twin_.shape != new.shape:
        return None
    a, b = np.asarray(old, np.float64).ravel(), np.asarray(new, np.float64).ravel()
    c = float(a @ b / (a @ a)) if a @ a > 0 else 1.0
    leaf = _held({'d': (c * a).reshape(new.shape)}, {'d': new}, {'d': twin_})['d']
    if leaf.ok:
        return None
    return _loss_location(
        step,
        f'the gradient of the training loss with respect to it is {_e(leaf.max_abs)} apart once one factor '
        f'({c:.4g}: the reduction) is taken out (allowed {_e(leaf.limit)}): the loss the step trains on differs '
        '(label smoothing, weights, masking), whether or not the loss it reports does',
    )


def _backward(step: _Step) -> Location | None:
    ref, other = step.grads('legacy'), step.grads('nnx')
    if not ref or not other:
        return None
    held = _held(ref, other, step.grads('twin') or other)
    bad = sorted((leaf for leaf in held.values() if not leaf.ok), key=lambda leaf: -step.order(leaf.path))
    if not bad:
        return None
    return Location(
        'backward', step.inverse.get(bad[0].path, bad[0].path), bad[0].path,
        f'the forward pass and the loss agree; its gradient is {_e(bad[0].max_abs)} apart (allowed '
        f'{_e(bad[0].limit)}), the first of {len(bad)} that part from the output back: the backward pass '
        'differs (a custom_vjp, a stop_gradient, a gradient scale)',
    )  # fmt: skip


def _statistics(step: _Step) -> Location | None:
    module = lambda path: path.partition('/')[2].rpartition('/')[0]  # noqa: E731 -- batch_stats/bn1/mean -> bn1
    bad = sorted((x for x in step.held('model_state').values() if not x.ok), key=lambda x: step.order(module(x.path)))
    if not bad:
        return None
    leaf, stat = bad[0], bad[0].path.partition('/')[2]
    return Location(
        'statistics', step.inverse.get(stat, stat).rpartition('/')[0], module(leaf.path),
        f'the forward pass, the loss and the gradients agree; {leaf.path} after one step is {_e(leaf.max_abs)} '
        f'apart (allowed {_e(leaf.limit)}): its running statistics are updated differently'
        + _momenta(step, module(leaf.path)),
    )  # fmt: skip


def _momenta(step: _Step, module: str) -> str:
    """The momentum of each side's one-step update of ``module``'s mean, its batch mean taken from
    the module's recorded input (features on the last axis)."""
    before = {step.mapping.get(p, p): a for p, a in convert.flatten(step.variables.get('batch_stats', {})).items()}
    source = next((old for old, new in step.paired.items() if new == module), None)
    record = step.raw['nnx'].get(module)
    if step.step > 1 or f'{module}/mean' not in before or source is None or record is None or not record.values[0][0]:
        return ''
    said = []
    for side in ('legacy', 'nnx'):
        x = record.values[0][0][0]
        x = intercept.value(step.raw['legacy'][source], 0, 0, x) if side == 'legacy' else x
        mean = np.asarray(x, np.float64).reshape(-1, x.shape[-1]).mean(axis=0)
        m = implied.momentum(
            before[f'{module}/mean'], step.final(side, 'model_state')[f'batch_stats/{module}/mean'], mean
        )
        said.append(f'{side} {m:.4g}' if m is not None else f'{side} -')
    return f'; the momentum its one-step update of the mean implies: {", ".join(said)}'


def _update(step: _Step) -> Location | None:
    params, slots = step.held('params'), step.held('opt_state')
    bad_slot = next((leaf for leaf in slots.values() if not leaf.ok), None)
    bad_param = next((leaf for leaf in params.values() if not leaf.ok), None)
    if bad_slot is None and bad_param is None:
        return None
    grads = 'the gradients agree' if step.grads('legacy') else "the gradients are not observed (the port's own step)"
    said = _implied(step)
    said = f'; the update implies: {said}' if bad_param is not None or implied.NO_UPDATE in said else (
        '; the parameters after one step agree')  # fmt: skip
    read = _moments(step, params, slots)
    uneven = next(((s, m) for s, m in read.items() if s.rpartition('/')[2] in FIRST and m.factor is None), None)
    if uneven is not None and 'unevenly' in uneven[1].text:
        slot, m = uneven
        param = m.leaf[len(slot) + 1 :]
        leaf = slots[m.leaf]
        return Location(
            'backward', step.inverse.get(param, param), param,
            f'the forward pass, the loss and the statistics agree, {grads}; {m.text}. The first moment of this '
            f"parameter, opt_state {m.leaf}, is {_e(leaf.max_abs)} apart (allowed {_e(leaf.limit)}); the update's "
            'size is not read (what it implies assumes the same gradients)',
        )  # fmt: skip
    if bad_slot is not None:
        param = _param_of(bad_slot.path, params)
        slot = bad_slot.path[: -len(param) - 1] if param else bad_slot.path
        first = next((m for s, m in read.items() if s.rpartition('/')[2] in FIRST), None)
        read_here = read.get(slot)
        if (
            read_here is not None
            and read_here.even
            and slot.endswith('nu')
            and first is None
            and any(s.rpartition('/')[2] == 'mu' for s in _slot_names(slots, params))
        ):
            said = '; the first moments agree, so the gradients do: (1 - b2) differs' + said
        if read_here is not None:
            said = f'; {read_here.text}{said}'
        return Location(
            'update', f'opt_state {slot}/{step.inverse.get(param, param)}' if param else f'opt_state {slot}',
            f'opt_state {bad_slot.path}',
            f'the forward pass, the loss and the statistics agree, {grads}; the optimizer slot {slot} is the first '
            f'that parts {step.after} ({_e(bad_slot.max_abs)} apart, allowed {_e(bad_slot.limit)}){said}',
        )  # fmt: skip
    return Location(
        'update', 'the update rule', 'the update rule',
        f'the forward pass, the loss, the statistics and every optimizer slot agree, {grads}; the parameters '
        f'{step.after} do not ({bad_param.path} {_e(bad_param.max_abs)} apart, allowed {_e(bad_param.limit)}){said}',
    )  # fmt: skip


FIRST = ('mu', 'trace')  # a first moment's slot: Adam's (1 - b1) g, SGD momentum's g, after one step from 0


def _param_of(path: str, params: dict) -> str:
    """The parameter an optimizer-state leaf ``path`` (``0/mu/block/fc1/kernel``) holds a slot of ('' none)."""
    return next((p for p in sorted(params, key=len, reverse=True) if path.endswith('/' + p)), '')


def _slot_names(slots: dict, params: dict) -> dict[str, list[str]]:
    """Slot (``0/mu``) -> its leaves' paths, for every leaf that holds a slot of a parameter."""
    out: dict[str, list[str]] = {}
    for path in slots:
        param = _param_of(path, params)
        if param:
            out.setdefault(path[: -len(param) - 1], []).append(path)
    return out


def _moments(step: _Step, params: dict, slots: dict) -> dict:
    """Slot -> ``implied.moments`` for each first or second moment (``mu``, ``trace``, ``nu``) that parts."""
    p0 = step.before()
    ends = [step.final(side, 'opt_state') for side in ('legacy', 'nnx')]
    read = {}
    for slot, paths in _slot_names(slots, params).items():
        kind = slot.rpartition('/')[2]
        if kind not in (*FIRST, 'nu') or all(slots[p].ok for p in paths):
            continue
        leaves = {p: (ends[0][p], ends[1][p], slots[p].limit or 0.0) for p in paths if p in ends[0] and p in ends[1]}
        found = implied.moments(kind, leaves, {p: p0[p[len(slot) + 1 :]] for p in paths if p[len(slot) + 1 :] in p0})
        if found is not None:
            read[slot] = found
    return read


def _implied(step: _Step) -> str:
    """``implied.update`` on every parameter both sides hold, and any learning rate the state exposes."""
    start = step.before()
    ends = [step.final(side, 'params') for side in ('legacy', 'nnx')]
    keys = [k for k in start if all(k in e for e in ends)]
    if not keys:
        return 'nothing (no parameter is held by both sides)'
    cat = lambda d: np.concatenate([np.asarray(d[k], np.float64).ravel() for k in keys])  # noqa: E731
    p0, grads, scale = cat(start), step.grads('legacy'), 1.0
    if not grads:  # a loop port: Adam's first moment is (1 - b1) g after one step
        mu = {k: v for k, v in step.final('legacy', 'opt_state').items() if '/mu/' in f'/{k}'}
        grads = {next((k for k in keys if name.endswith('/' + k)), ''): v for name, v in mu.items()}
        scale = 1 - implied.NESTEROV_B1
    g = cat(grads) / scale if all(k in grads for k in keys) else None
    text = implied.update(p0, cat(ends[0]) - p0, cat(ends[1]) - p0, g, scale != 1.0)
    rates = [
        {k: v for k, v in step.final(side, 'opt_state').items() if 'learning_rate' in k} for side in ('legacy', 'nnx')
    ]
    shown = [f'{k} pmap {float(np.ravel(v)[0]):.6g}, NNX {float(np.ravel(rates[1][k])[0]):.6g}'
             for k, v in rates[0].items() if k in rates[1]]  # fmt: skip
    return '; '.join([text, *(['the state holds ' + '; '.join(shown)] if shown else [])])


# -- the location ------------------------------------------------------------------------------


def judge_step(
    port_kind: Kind, results: dict, raw: dict, mapping: dict[str, str], variables: dict, at: int = 1, start=None
) -> Location:
    """The first place the recorded first steps part (``results`` and ``raw`` of ``intercept.first_steps``);
    ``at`` > 1: the records of step ``at`` (its last) and the state after it, ``start`` the pmap side's
    parameters before it (NNX paths; nothing parted before it)."""
    paired = pairs(raw.get('legacy', {}), raw.get('nnx', {}), mapping, port_kind.port.names)
    modules = _modules(raw, paired) if paired else []
    step = _Step(port_kind, results, raw, mapping, variables, modules, paired, at, start)
    notes = _notes(port_kind, raw, paired, 'twin' in results)
    for stage in (_forward, _loss, _backward, _statistics, _update):
        found = stage(step)
        if found is not None and stage is _loss and any(n.startswith('not observed') for n in notes):
            found = Location('unlocated', '', '', f'the first loss parts ({found.figures}), and the forward pass '
                             'was not observed on both sides: not localised further')  # fmt: skip
        if found is not None:
            said = [n for n in notes if stage is _update or not n.startswith("a loop port's gradients")]
            figures = found.figures
            if at > 1:
                warmup = (
                    "; step 1's update is 0, as warmup gives" if _first_update_is_0(results, variables, mapping) else ''
                )
                figures = f'on step {at} (nothing parts before it{warmup}): {figures}'
            return dataclasses.replace(found, figures=figures, modules=tuple(modules), notes=tuple(said))
    checked = 'the loss, the gradients, ' if step.grads('legacy') else 'the loss, '
    later = 'the sides part later (a schedule, or growth from rounding)'
    if at > 1:
        later = f'whatever parts does so after step {at}, or through growth from rounding'
    elif implied.NO_UPDATE in _implied(step):
        later = f'{WARMUP} (a schedule at 0 on step 1, as warmup gives): an optimizer that differs shows later'
        held = step.held('opt_state')
        if not step.grads('legacy') and any(
            s.rpartition('/')[2] in FIRST for s in _slot_names(held, step.held('params'))
        ):
            later += " (this loop port's gradients are not observed; its first moments, which hold them, agree)"
        elif not step.grads('legacy'):
            later += (
                ', and so may gradients that differ (a training loss the reported loss does not show, the backward '
                "pass): this loop port's gradients are not observed, and no first moment holds them"
            )
    first = 'the first step' if at == 1 else f'steps 1 to {at}'
    return Location(
        'none', '', '',
        f'nothing parts on {first}: {len(modules)} module calls, {checked}the statistics, the parameters and '
        f'the optimizer state are within their floors; {later}',
        tuple(modules), None, tuple(notes),
    )  # fmt: skip


def _notes(port_kind: Kind, raw: dict, paired: dict, twin_ran: bool) -> list[str]:
    """What was not paired or not observed, and why."""
    notes = []
    calls = {side: [label for label in raw.get(side, {}) if label not in NOT_MODULES] for side in ('legacy', 'nnx')}
    for side, what in (('legacy', 'the pmap step called no linen'), ('nnx', 'the NNX step called no NNX')):
        if not calls[side]:
            notes.append(f'not observed: {what} module the suite could intercept (an opaque or precompiled '
                         'function, or no flax module): its forward pass is not localised')  # fmt: skip
    left = [label for label in calls['legacy'] if label not in paired]
    if calls['legacy'] and calls['nnx'] and left:
        shown = ', '.join(label or ROOT for label in left[:4]) + (f' and {len(left) - 4} more' if len(left) > 4 else '')
        notes.append(f'{len(paired)} of {len(calls["legacy"])} linen module calls paired with NNX ones '
                     f'({len(calls["nnx"])} recorded); not paired: {shown}')  # fmt: skip
    if not twin_ran:
        notes.append('no twin in this process: each value is held to 8 float32 spacings of its largest value')
    if not port_kind.observes_grads:
        notes.append("a loop port's gradients are its own step's: not observed (its first moment, which holds them "
                     'after one step, is read for them)')  # fmt: skip
    return notes


def here(n_twin: twin.TwinKind | None, config: RunConfig, inputs) -> twin.TwinKind | None:
    """The twin the first steps run in this process: None where it ran in a fresh process
    (``judge.one_twin``: it needs more devices than this process sees, or it raised here, as code
    pinned to a mesh of its own does), or needs more devices than this process sees."""
    if n_twin is None or n_twin in inputs.fresh_twins:
        return None
    return None if twin.devices_of(n_twin, config) > len(jax.local_devices()) else n_twin


def first_steps(port_kind: Kind, config: RunConfig, inputs, n_twin: twin.TwinKind | None) -> tuple[dict, dict]:
    """``intercept.first_steps`` once per verdict, kept on ``inputs`` (``judge.Inputs``): the gradient
    probe and the location share one more first step per side and the twin's (``n_twin``, as ``here``
    keeps it; None: no twin, each value then held to 8 float32 spacings)."""
    n_twin = here(n_twin, config, inputs)
    if inputs.first_steps is None or inputs.first_steps[0] != n_twin:
        runs = intercept.first_steps(port_kind, config, inputs.variables, inputs.calls, inputs.rng, n_twin)
        inputs.first_steps = (n_twin, *runs)
    return inputs.first_steps[1:]


def first_step_grads(port_kind: Kind, config: RunConfig, inputs, n_twin: twin.TwinKind | None) -> dict[str, dict]:
    """``{'legacy', 'nnx', 'twin'}`` -> the first gradient by NNX path (the twin's: NNX's without a
    twin). Where the recorded steps cannot run, the plain probe's (``probe.first_steps``): the
    location then says why it has none, and the verdict is as it was without it."""
    n_twin = here(n_twin, config, inputs)
    mapping = setups.check_names(port_kind.port, inputs.variables)
    try:
        raw = first_steps(port_kind, config, inputs, n_twin)[1]
    except Exception:  # noqa: BLE001 -- a port's own error raises again below, as it always did
        twin_setup = port_kind.twin_setup(config, inputs.variables, n_twin) if n_twin else None
        steps = probe.first_steps(port_kind, config, inputs.variables, inputs.calls, inputs.rng, twin_setup)
        return {side: steps[side].grads for side in ('legacy', 'nnx', 'twin')}
    grads = {side: recorded_grads(raw, side, mapping) for side in ('legacy', 'nnx', 'twin')}
    return {**grads, 'twin': grads['twin'] or grads['nnx']}


MAX_STEPS = 8  # the most steps recorded to find the first that parts


def locate(port_kind: Kind, config: RunConfig, inputs, n_twin: twin.TwinKind | None) -> Location:
    """Where the first step parts (``inputs``: a ``judge.Inputs``, the checked runs' inputs). Where
    nothing parts on step 1, the checked runs' first steps (up to ``MAX_STEPS``) are recorded again, the
    first whose parameters part is found, and that step is judged as step 1 was: a warmup whose first
    update is 0 hides an optimizer's eps or nesterov on step 1, a schedule that differs later shows
    where it starts."""
    mapping = setups.check_names(port_kind.port, inputs.variables)
    found = judge_step(port_kind, *first_steps(port_kind, config, inputs, n_twin), mapping, inputs.variables)
    steps = min(MAX_STEPS, sum(jax.tree.leaves(call)[0].shape[0] for call in inputs.calls))
    if found.kind != 'none' or steps < 2:
        return found
    n_twin = here(n_twin, config, inputs)
    for n in sorted({2, steps}):  # step 2 first: where a warmup's zero first update hid the slip, one run
        results, raw = intercept.first_steps(port_kind, config, inputs.variables, inputs.calls, inputs.rng, n_twin, n)
        at = _first_parting(results, n)
        if at is not None:
            break
    if at is None:
        return judge_step(port_kind, results, raw, mapping, inputs.variables, at=steps)
    if at < n:
        results, raw = intercept.first_steps(port_kind, config, inputs.variables, inputs.calls, inputs.rng, n_twin, at)
    start = results['legacy'].params_per_call[at - 2] if at > 1 else None
    return judge_step(port_kind, results, raw, mapping, inputs.variables, at=at, start=start)


def _first_parting(results: dict, steps: int) -> int | None:
    """The first step (1-based) after which the parameters part, each held to its floor; None: none."""
    sides = [results.get(side) or results['nnx'] for side in ('legacy', 'nnx', 'twin')]
    for j in range(steps):
        if any(not leaf.ok for leaf in _held(*(r.params_per_call[j] for r in sides)).values()):
            return j + 1
    return None


def _initial(variables: dict, mapping: dict[str, str]) -> dict[str, np.ndarray]:
    """The parameters before step 1 (linen's ``variables``), by NNX path."""
    return {mapping.get(p, p): a for p, a in convert.flatten(variables.get('params', {})).items()}


def _first_update_is_0(results: dict, variables: dict, mapping: dict[str, str]) -> bool:
    """Whether the pmap side's first step moved no parameter."""
    start = _initial(variables, mapping)
    after = results['legacy'].params_per_call[0]
    return all(np.array_equal(after[k], start[k]) for k in after if k in start)


def attach(verdict, port_kind: Kind, config: RunConfig, inputs, n_twin: twin.TwinKind | None):
    """``verdict`` (``rule.Verdict``) with its ``location``: on MISMATCH, or on MATCH when
    ``config.locate`` asks (never when it is False); where it cannot run (several processes, after
    --resume-at) or raises, the location says so and the verdict stands."""
    if config.locate is False or (verdict.match and not config.locate):
        return verdict
    cannot = inputs.single_process_probes()
    if cannot:
        return dataclasses.replace(verdict, location=Location('unlocated', '', '', f'not run: {cannot}'))
    try:
        found = locate(port_kind, config, inputs, n_twin)
    except Exception as e:  # noqa: BLE001 -- the verdict stands; the location says why there is none
        found = Location('unlocated', '', '', f'the locating run raised {type(e).__name__}: {str(e)[:200]}')
    said = trust(verdict.kind, found)
    return dataclasses.replace(verdict, location=dataclasses.replace(found, notes=(*found.notes, *said)))


AGREES = {  # a location's kind -> the diagnosis kinds (rule.diagnose) that say the same
    'module': ('math',),
    'between': ('math',),
    'randomness': ('randomness',),
    'loss': ('math', 'update'),
    'backward': ('update',),
    'statistics': ('state',),
    'update': ('optimizer', 'update'),
}


def trust(kind: str, found: Location) -> list[str]:
    """A note when the diagnosis's ``kind`` and the location's disagree: which one to believe."""
    if not kind or found.kind not in AGREES or kind in AGREES[found.kind]:
        return []
    return [
        f'the diagnosis says {kind}, this line says {found.kind}: trust this line. It holds each module call, the '
        "loss, the gradients and the optimizer's slots of the first step to their own floors; the diagnosis reads "
        'the leaves after training, when the difference has spread (a first loss that agrees, as a zero-initialised '
        'head or a warmup gives, hides a forward slip from it)'
    ]
