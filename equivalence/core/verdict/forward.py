"""The forward stage of the locator (``forward``): the first module call of the first step whose input or
output parts beyond its floor, in the order the pmap side's calls finished: the code that feeds it
(``between``), the module itself (``module``), or a Dropout's draw (``randomness``).
"""

from equivalence.core.verdict.location import ROOT, Location, Module, sci
from equivalence.core.verdict.stages import Step

BETWEEN = 'the code between them (an activation, a residual, a mask)'


def forward(step: Step) -> Location | None:
    for i, m in enumerate(step.modules):
        if not m.input_ok:
            return _fed(step, i, m)
        if not m.output_ok:
            return _parted(step, i, m)
    return None


def _fed(step: Step, i: int, m: Module) -> Location:
    """Module call ``m``'s input parts while every call before it agrees: the code that feeds it."""
    before = step.modules[i - 1] if i else None
    attention = next((c for c in step.modules if m.legacy.startswith(c.legacy + '/') and 'Attention' in c.cls), None)
    what = 'an activation, a residual, a mask'
    if attention is not None:
        what = f'inside {attention.legacy}: the attention weights (scale, mask, softmax, dropout)'
        what += settings_differ(step, attention).replace('; its settings', f"; {attention.legacy}'s settings", 1)
    return Location(
        'between',
        f'{before.legacy if before else "(the inputs)"} → {m.legacy}',
        f'{before.new if before else "(the inputs)"} → {m.new}',
        f'everything before agrees; the input of {m.legacy} is {sci(m.input_diff)} apart (allowed '
        f'{sci(m.input_allowed)}): the code{f" after {before.legacy}" if before else ""} that feeds it differs '
        f'({what})',
        first=i,
    )


def settings_differ(step: Step, m: Module) -> str:
    """The scalar settings the two sides' calls ``m`` hold under one name with other values ('' none):
    ``; its settings differ: epsilon 1e-06 ↔ 1e-05``."""
    legacy_label = '' if m.legacy == ROOT else m.legacy
    nnx_label = step.paired.get(legacy_label, '')
    records = [step.raw.get('legacy', {}).get(legacy_label), step.raw.get('new', {}).get(nnx_label)]
    if records[0] is None or records[1] is None:
        return ''
    a, b = (dict(r.settings) for r in records)
    differ = [f'{k} {a[k]!r} ↔ {b[k]!r}' for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]
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
            'randomness', m.legacy, m.new, f'{inputs}, {apart}: the two sides draw other masks{said}{rule}', first=i
        )
    if inside:
        what = 'the attention weights (scale, mask, softmax, dropout)' if 'Attention' in m.cls else BETWEEN
        return Location(
            'between', f'{m.legacy} (inside)', f'{m.new} (inside)',
            f'{inputs} and its {len(inside)} submodule call(s) agree, {apart}: {what}{said}', first=i,
        )  # fmt: skip
    return Location('module', m.legacy, m.new, f'{inputs}, {apart}: it computes something else{said}', first=i)
