"""The stages of the first step the locator holds to their floors, in order: the forward pass, module by
module (``forward.forward``), the loss (``loss``), the backward pass (``backward``); the update is ``slots``',
the running statistics and the EMA ``averages``'. Here too what they share: a tree held to its floor
(``held``), the module calls paired and judged (``modules_of``), the step as they read it (``Step``). Each
stage returns a ``Location``, or None where nothing parts.
"""

import dataclasses

import numpy as np

from equivalence.core.compare import compare
from equivalence.core.compare.location import ROOT, Location, Module, Unplaced, over, read, sci
from equivalence.core.compare.rule import MEASURED_FLOOR
from equivalence.core.port.kind import Kind
from equivalence.core.record import intercept, pairing
from equivalence.core.record.intercept import DOUT, LOSS, NOT_MODULES
from equivalence.core.record.pairing import recorded_grads
from equivalence.core.state import convert


def held(
    ref: dict, other: dict, twin_: dict, siblings: bool = False, noisy=frozenset(), owner=None
) -> dict[str, compare.LeafDiff]:
    """Every leaf held to its floor (``twin_`` missing a leaf: floor 0), by path.

    ``siblings`` (parameters, gradients, optimizer slots): a leaf may also differ by ``MIN_ULPS`` float32
    spacings of the largest value among its module's leaves of that tree. A bias before a GroupNorm or a
    BatchNorm has a true gradient of 0: what it holds is what is left of sums of terms the size of its
    kernel's gradient, rounding only, and the twin may sum it in the very order NNX does (a floor of 0).
    ``noisy``: the parameters the verdict found noise-dominated (by path): they, and every slot of
    theirs, are never where the sides part (their difference is reordering). And with ``siblings``, a leaf
    may differ by ``SAFETY`` times the twin's relative floor pooled over the tree's leaves (``pooled``)
    times its largest value: on one step the twin can sum a leaf in the very order NNX does (a floor of 0
    there) while reordering moves the leaves beside it, so a leaf's own floor alone names rounding as a
    place (score_sde's Adam first moments, NNX / pmap 1 to 1 over 27 leaves, 'unevenly'). ``owner(path)``:
    whose leaves are siblings (default: the module, the path less its last name); an optimizer slot's
    and a gradient's are the whole slot's (``slot_owner``): behind a head initialised at 1e-10 of its
    scale (score_sde's), every gradient before it is 1e-20 and sums of much larger terms, rounding only."""
    report = compare.compare_to_floor({'g': ref}, {'g': other}, {'g': twin_}, MEASURED_FLOOR)
    scale: dict[str, float] = {}
    rel = pooled(other, twin_, noisy) if siblings else 0.0
    owner = owner or (lambda path: path.rpartition('/')[0])
    if siblings:
        for path, a in ref.items():
            if compare.is_float(np.asarray(a).dtype):
                whose = owner(path)
                scale[whose] = max(scale.get(whose, 0.0), float(np.abs(np.asarray(a, np.float64)).max(initial=0.0)))
    out = {}
    for leaf in report.leaves:
        if leaf.limit is not None and not leaf.ok:
            if owned_by(leaf.path, noisy):
                leaf = dataclasses.replace(leaf, ok=True, noise_dominated=True)
            elif siblings:
                top = float(np.abs(np.asarray(ref[leaf.path], np.float64)).max(initial=0.0))
                beside = MEASURED_FLOOR.min_ulps * compare.spacing32(scale.get(owner(leaf.path), 0.0))
                allowed = max(leaf.limit, beside, MEASURED_FLOOR.safety * rel * top)
                if leaf.max_abs <= allowed:
                    leaf = dataclasses.replace(leaf, ok=True, limit=allowed)
        out[leaf.path] = leaf
    return out


def owned_by(path: str, params) -> bool:
    """Whether ``path`` is one of ``params`` or a slot of one (``0/mu/<param>``)."""
    return any(path == p or path.endswith('/' + p) for p in params)


def slot_owner(params: dict):
    """An optimizer-state leaf's slot (``0/mu`` of ``0/mu/block/fc/kernel``), given the parameters' paths; a
    gradient's (a parameter's own path): the whole tree ('')."""
    names = sorted(params, key=len, reverse=True)

    def owner(path: str) -> str:
        param = next((p for p in names if path == p or path.endswith('/' + p)), None)
        return path[: -len(param) - 1] if param and path != param else ''

    return owner


POOLED = 90  # the percentile of the leaves' relative twin floors a tree's pooled floor is


def pooled(nnx: dict, twin_: dict, noisy=frozenset()) -> float:
    """The twin's relative floor over a tree's leaves, ``|nnx - twin| / max |nnx|`` per leaf, at its
    ``POOLED``th percentile; 0 where no twin differs. The noise-dominated parameters and their slots
    (``noisy``), whose relative floor is about 1, are left out: where they are more than a tenth of the
    tree (a user's conv net with a bias before each BatchNorm, issue 60: 7 of 25 leaves) they would set it,
    and allow every leaf 10x its own scale (its clip and b2 slips then parted nowhere)."""
    rels = []
    for path, a in nnx.items():
        if owned_by(path, noisy):
            continue
        b = twin_.get(path)
        a = np.asarray(a)
        if b is None or not compare.is_float(a.dtype) or np.shape(b) != a.shape:
            continue
        top = float(np.abs(a.astype(np.float64)).max(initial=0.0))
        if top > 0:
            rels.append(float(np.abs(a.astype(np.float64) - np.asarray(b, np.float64)).max(initial=0.0)) / top)
    return float(np.percentile(rels, POOLED)) if rels else 0.0


def worst(leaves: list) -> compare.LeafDiff | None:
    return max(leaves, key=lambda leaf: over(leaf.max_abs, leaf.limit), default=None)


def modules_of(raw: dict, paired: dict[str, str]) -> list[Module]:
    trees = pairing.trees(raw, paired)
    by = held(*trees)
    out = []
    for old in sorted(paired, key=lambda label: raw['legacy'][label].order):
        new = paired[old]
        ins = worst([leaf for path, leaf in by.items() if path.startswith(f'{new}/in/')])
        outs = worst([leaf for path, leaf in by.items() if path.startswith(f'{new}/out/')])
        # not compared: the sides take their arrays in another number, or part by exactly a residual (a module cut
        # otherwise on each side, not a slip)
        unseen = old and (
            (outs is None and pairing.other_inputs(raw['legacy'][old], raw['new'][new]))
            or (outs is not None and not outs.ok and (ins is None or ins.ok)
                and pairing.residual_moved(trees, new, outs.limit))
        )  # fmt: skip
        out.append(Module(
            old or ROOT, new or ROOT, raw['legacy'][old].cls,
            ins.max_abs if ins else 0.0, ins.limit if ins else None, ins is None or ins.ok,
            None if unseen else outs.max_abs if outs else 0.0, outs.limit if outs else None,
            outs.floor if outs else None, unseen or outs is None or outs.ok,
        ))  # fmt: skip
    return out


@dataclasses.dataclass
class Step:
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
    noisy: frozenset = frozenset()  # parameters the verdict found noise-dominated: never the place (``held``)
    prior: dict | None = None  # the pmap side's optimizer state before the judged step (step 1's), where known

    def before(self) -> dict[str, np.ndarray]:
        """The parameters before the judged step, by NNX path."""
        return self.start if self.start is not None else initial_params(self.variables, self.mapping)

    @property
    def after(self) -> str:
        return 'after one step' if self.step == 1 else f'after step {self.step}'

    @property
    def inverse(self) -> dict[str, str]:
        return {new: old for old, new in self.mapping.items()}

    def final(self, side: str, group: str) -> dict:
        result = self.results.get(side) or self.results['new']
        return result.final.get(group) or {}

    def held(self, group: str) -> dict[str, compare.LeafDiff]:
        owner = slot_owner(self.final('legacy', 'params')) if group == 'opt_state' else None
        return held(self.final('legacy', group), self.final('new', group), self.final('twin', group),
                    siblings=group != 'model_state', noisy=self.noisy, owner=owner)  # fmt: skip

    def order(self, path: str) -> int:
        """When NNX module ``path``, or the one holding it, finished its first call (last when none)."""
        done = {label: r.order for label, r in self.raw.get('new', {}).items() if '#' not in label}
        owners = [p for p in done if p not in NOT_MODULES and (not p or path == p or path.startswith(p + '/'))]
        return done[max(owners, key=len)] if owners else 1 << 30

    def grads(self, side: str) -> dict[str, np.ndarray]:
        return recorded_grads(self.raw, side, self.mapping)


def loss(step: Step) -> Location | None:
    sides = ('legacy', 'new', 'twin')
    trees = [{'mean': np.float32((step.results.get(s) or step.results['new']).losses[-1])} for s in sides]
    records = [step.raw.get(s, {}).get(LOSS) for s in sides]
    if records[0] is not None and records[1] is not None:
        like = records[1].values[0][1][0]
        for tree, record in zip(trees, records, strict=True):
            tree['per-example'] = like if record is None else intercept.value(record, 0, 1, like)
    leaf = worst([leaf for leaf in held(*trees).values() if not leaf.ok])
    if leaf is None:
        return _output_grad(step)
    parted = terms(step)
    if parted is not None:
        return _term_location(step, *parted, leaf)
    return _loss_location(
        step,
        f'the {leaf.path} loss is {sci(leaf.max_abs)} apart (allowed {sci(leaf.limit)}): '
        'the loss function differs (label smoothing, weights, reduction, masking)',
        read(parts='loss', leaf=leaf.path, apart=leaf.max_abs, allowed=leaf.limit),
    )


TERMS_SUM = 1e-5  # relative: the reported terms of a loss add up to it, up to the rounding of their sum


def terms(step: Step) -> tuple[list[compare.LeafDiff], list[str]] | None:
    """``(the terms that part, held to their floors; the terms that agree)`` where the step reports its loss term by
    term among its metrics (scalars beside each other whose sum, on the pmap side, is the loss it reports: a NeRF's
    ``losses/data``, ``losses/interlevel``, ``losses/distortion``) and some, not all, of them part on the judged step;
    None otherwise. A loss weight that differs shows in its own term alone (a distortion weight slipped: that term
    90% apart, the others equal)."""
    sides = [step.results.get(s) or step.results['new'] for s in ('legacy', 'new', 'twin')]
    last = [{p: np.asarray(a)[-1] for p, a in r.metrics.items() if np.size(a) == len(r.losses)} for r in sides]
    loss = float(sides[0].losses[-1])
    groups: dict[str, list[str]] = {}
    for path, value in last[0].items():  # the loss itself, reported as a metric too, is no term of it
        if path in last[1] and path in last[2] and np.float32(value) != np.float32(loss):
            groups.setdefault(path.rpartition('/')[0], []).append(path)
    for group in groups.values():
        total = sum(float(last[0][p]) for p in group)
        if len(group) < 2 or abs(total - loss) > TERMS_SUM * max(abs(loss), compare.spacing32(1.0)):
            continue
        judged = held(*({p: np.float32(values[p]) for p in group} for values in last))
        parted = sorted((judged[p] for p in group if not judged[p].ok), key=lambda leaf: -leaf.max_abs)
        if 0 < len(parted) < len(group):
            return parted, [p for p in group if judged[p].ok]
    return None


def _term_location(step: Step, parted: list, agreed: list[str], loss: compare.LeafDiff) -> Location:
    """A ``loss`` location at the terms of the loss that part, the others agreeing."""
    names = step.port_kind.loss_names()
    shown, top, others = ' and '.join(leaf.path for leaf in parted), parted[0], ' and '.join(agreed)
    apart = f'{sci(top.max_abs)} apart (allowed {sci(top.limit)})'
    if len(parted) == 1:
        said = f'the loss term {shown} is {apart} while {others} {"agrees" if len(agreed) == 1 else "agree"}: that term'
        said += ' differs (its weight, or how it is computed)'
    else:
        said = (
            f'the loss terms {shown} part ({top.path} {apart}) while {others} '
            f'{"agrees" if len(agreed) == 1 else "agree"}: they differ (their weights, or how they are computed)'
        )
    figures = f'{said}; the {loss.path} loss is {sci(loss.max_abs)} apart'
    values = read(parts='loss term', terms=tuple(leaf.path for leaf in parted), agreed_terms=tuple(agreed),
                  leaf=top.path, apart=top.max_abs, allowed=top.limit)  # fmt: skip
    found = _loss_location(step, figures, values)
    return dataclasses.replace(found, legacy=f'{names[0]} term {shown}', new=f'{names[1]} term {shown}')


def _loss_location(step: Step, figures: str, values: tuple) -> Location:
    """A ``loss`` location: the two sides' loss functions, and whether the model's output agrees first. Not
    located where the model's output was not compared: the pmap side's outermost module call recorded and not
    paired, or an outermost call (on either side) paired but whose outputs do not compare (``forward.outermost_unseen``:
    Hugging Face's GPT-2 returns a tuple of hidden states where the NNX model returns the logits). The model's own
    code after its last compared call is then unseen, and the loss is no better a place than it (google/mipnerf's
    rgb padding, tried blind, its model unpaired, was 'loss')."""
    compared = lambda m: m.output_ok and m.output_diff is not None and np.isfinite(m.output_diff)  # noqa: E731
    root = next((m for m in step.modules if m.legacy == ROOT), None)
    unseen = any(ROOT in (m.legacy, m.new) and not compared(m) for m in step.modules)
    if unseen or (root is None and '' in step.raw.get('legacy', {})):
        return Location(
            'unlocated', '', '',
            "not located: every module call compared agrees and the loss parts, but the model's output was not "
            'compared (its outermost call is not paired with a new one, or its arrays do not compare): the model\'s '
            'own code after its last compared call may be where they part as well as the loss',
            why=Unplaced.OUTPUT_UNCOMPARED, read=values,
        )  # fmt: skip
    model = f"the model's output agrees ({sci(root.output_diff)} apart); " if root is not None else ''
    names = step.port_kind.loss_names()
    output = read(output_apart=root.output_diff) if root is not None else ()
    return Location('loss', names[0], names[1], model + figures, read=output + values)


def _output_grad(step: Step) -> Location | None:
    """The training loss's gradient with respect to the model's output (``DOUT``), where the forward pass
    agrees: it parts when the step trains on another loss than the other side's, reported or not (a loop
    port's reported loss may leave out the label smoothing it trains with). One factor between the sides
    is taken out first: the reduction (a mean per device, then pmean, against one global mean) scales it."""
    records = [step.raw.get(side, {}).get(DOUT) for side in ('legacy', 'new', 'twin')]
    if records[0] is None or records[1] is None:
        return None
    new = intercept.value(records[1], 0, 1)
    old = intercept.value(records[0], 0, 1, new)
    twin_ = intercept.value(records[2], 0, 1, new) if records[2] is not None else new
    if old.shape != new.shape or twin_.shape != new.shape:
        return None
    a, b = np.asarray(old, np.float64).ravel(), np.asarray(new, np.float64).ravel()
    c = float(a @ b / (a @ a)) if a @ a > 0 else 1.0
    leaf = held({'d': (c * a).reshape(new.shape)}, {'d': new}, {'d': twin_})['d']
    if leaf.ok:
        return None
    return _loss_location(
        step,
        f'the gradient of the training loss with respect to it is {sci(leaf.max_abs)} apart once one factor '
        f'({c:.4g}: the reduction) is taken out (allowed {sci(leaf.limit)}): the loss the step trains on differs '
        '(label smoothing, weights, masking), whether or not the loss it reports does',
        read(parts='output gradient', reduction=c, apart=leaf.max_abs, allowed=leaf.limit),
    )


def backward(step: Step) -> Location | None:
    ref, other = step.grads('legacy'), step.grads('new')
    if not ref or not other:
        return None
    judged = held(ref, other, step.grads('twin') or other, siblings=True, noisy=step.noisy, owner=slot_owner(ref))
    bad = sorted((leaf for leaf in judged.values() if not leaf.ok), key=lambda leaf: -step.order(leaf.path))
    if not bad:
        return None
    return Location(
        'backward', step.inverse.get(bad[0].path, bad[0].path), bad[0].path,
        f'the forward pass and the loss agree; its gradient is {sci(bad[0].max_abs)} apart (allowed '
        f'{sci(bad[0].limit)}), the first of {len(bad)} that part from the output back: the backward pass '
        'differs (a custom_vjp, a stop_gradient, a gradient scale)',
        read=read(leaf=bad[0].path, apart=bad[0].max_abs, allowed=bad[0].limit, parting=len(bad)),
    )  # fmt: skip


def initial_params(variables: dict, mapping: dict[str, str]) -> dict[str, np.ndarray]:
    """The parameters before step 1 (linen's ``variables``), by NNX path."""
    return {mapping.get(p, p): a for p, a in convert.flatten(variables.get('params', {})).items()}
