"""The verdict in English: every sentence the report says of a verdict, written from its typed values
(``verdict.rule.Verdict``, ``verdict.findings``). The verdict decides and records; only this module words it,
for the text and for the JSON's ``verdict`` fields alike.
"""

from equivalence.core.compare.compare import LeafDiff
from equivalence.core.compare.findings import (
    Diagnosis,
    Finding,
    Hidden,
    NonFinite,
    Thin,
    Unmeasured,
)
from equivalence.core.compare.rule import NOT_VERIFIED_SHARE, Verdict
from equivalence.core.report import reach
from equivalence.core.report.measured import (  # noqa: F401
    PER_REPLICA,
    PROBES,
    SKIPS,
    excess,
    held,
    legacy_twin,
    reason,
    refusal,
    step,
    twin,
    unrun,
)

SHOWN = 3  # leaves named per group and side; the rest counted

NOISE_HIDES = (
    "the run's own rounding (its twin) moves them by about as much as legacy differs, so a slip there would pass "
    'unseen; every leaf is within its floor, and that proves nothing here; more steps (--calls) may move '
    'parameters that have barely left their initial values (a zero-initialised layer) beyond their noise, '
    "unless the twins' rounding grows as fast (an optimizer state kept in bfloat16)"
)


def lines(v: Verdict) -> list[str]:
    """What the verdict measured, its noise-dominated leaves, why NOT VERIFIED, the diagnosis, where it parts."""
    return [f'verdict: {v.mode}; ' + '; '.join(done(v)), *found(v)]


def found(v: Verdict) -> list[str]:
    """What the verdict found, without how it measured: its noise-dominated leaves, why NOT VERIFIED, the
    diagnosis, a MATCH's reach, where the sides part (the pytest plugin's failure shows these)."""
    out = []
    for leaf in v.noise_dominated:
        out.append(
            f'NOISE-DOMINATED {leaf.name}: {whose(leaf)}twin moves it by {leaf.floor:.2e} '
            f'(legacy differs by {leaf.max_abs:.2e}); its final value cannot verify it'
        )
    hides = f': {NOISE_HIDES}' if v.hidden_by_noise else ''
    out += [f'not verified: {unverified(v.unverified)}{hides}'] if v.unverified is not None else []
    out += [f'diagnosis ({v.kind}): {diagnosis(v.diagnosis)}'] if v.diagnosis is not None else []
    out += [said] if v.match and (said := reach.sensitivity(v.sensitivity)) else []
    out += v.location.lines() if v.location is not None else []
    return out + ([f'  {disagreement(v)}'] if disagree(v) else [])


def disagree(v: Verdict) -> bool:
    """Whether the verdict's diagnosis and its ``where:`` place are of different kinds (``Location.disagrees``)."""
    return v.location is not None and v.location.disagrees(v.kind)


def disagreement(v: Verdict) -> str:
    """The line under ``where:`` where the diagnosis is of another kind than the place (``Location.disagrees``)."""
    return (
        f'the diagnosis ({v.kind}) and where: ({v.location.kind}) disagree: where: holds the first step to its '
        'floors, the diagnosis reads the leaves after training'
    )


def whose(leaf: LeafDiff) -> str:
    return "the pmap side's " if leaf.floor_from == 'legacy' else 'the '


def done(v: Verdict) -> list[str]:
    """Each step the verdict took, in words, in the order it took them (a step with nothing to say is left out)."""
    said = [step(record) for record in v.done]
    return [s for s in said if s]


# -- NOT VERIFIED ------------------------------------------------------------------------------


def unverified(record: Unmeasured | Hidden | Thin | None) -> str:
    """Why a run is NOT VERIFIED, short; '' when it is not."""
    if record is None:
        return ''
    if isinstance(record, Thin):
        return reach.thin(record)
    if isinstance(record, Unmeasured):
        screen = (
            "the fixed screen passed, which is not a measure of this port's own noise"
            if record.screen_passed
            else f'outside the fixed screen, and nothing tells noise from a slip: {details(list(record.failed))}'
        )
        return f"no twin measured this port's noise floor ({twin(record.twin)}); {screen}"
    why = []
    if record.share is not None:
        why.append(f'{record.share:.1%} of the parameters are noise-dominated ({names(list(record.noisy))}), '
                   f'more than {NOT_VERIFIED_SHARE:.0%}')  # fmt: skip
    why += [f'the output layer is noise-dominated ({names(list(record.head))})'] if record.head else []
    why += ['the per-step losses are noise-dominated'] if record.losses else []
    return '; '.join(why)


def names(leaves: list[LeafDiff], n: int = 3) -> str:
    shown = ', '.join(leaf.name for leaf in leaves[:n])
    return shown + (f' and {len(leaves) - n} more' if len(leaves) > n else '')


# -- the diagnosis -----------------------------------------------------------------------------


def diagnosis(d: Diagnosis | None) -> str:
    """The line above the leaf table: what a MISMATCH is, and the leaves and figures it rests on."""
    if d is None:
        return ''
    also = f' (also: {bookkeeping(list(d.sided))})' if d.sided else ''
    later = details(list(d.leaves))
    if d.kind is Finding.NON_FINITE:
        return nonfinite(d.nonfinite)
    if d.kind is Finding.BOOKKEEPING:
        return bookkeeping(list(d.sided))
    if d.kind is Finding.RANDOMNESS:
        return (
            f"the first step's loss differs ({describe(d.leaves[0])}), but with dropout off on both sides it matches: "
            'the two sides draw different random numbers (dropout masks, or noise from another key)' + also
        )
    if d.kind is Finding.MATH and d.placed is None:
        return f'the first step already differs beyond its floor, before any update: {later}' + also
    if d.kind is Finding.UNMEASURED:
        return (
            f'outside the fixed tolerance, and no floor was measured to tell noise from a slip: {later}; '
            f'no twin measured one: {twin(d.no_floor) or "see the verdict line"}' + also
        )
    if d.kind is Finding.STATE:
        return (
            'the losses, parameters and optimizer state agree within their floor; only the model state does not: '
            f'{later}; a running statistic is updated differently (its momentum, epsilon or axis_name)' + also
        )
    if d.kind is Finding.EMA:
        return (
            'the losses, parameters and optimizer state agree within their floor; only the EMA does not: '
            f'{later}; the EMA is updated differently (its decay, its arithmetic, or which parameters '
            'it averages)' + also
        )
    if d.kind is Finding.METRICS:
        return (
            f'the losses, parameters and optimizer state agree within their floors; only metrics the steps report '
            f'do not: {later}; the step computes them otherwise (a formula, an epsilon, what they are taken of), '
            'not the training' + also
        )
    if d.kind is Finding.MATH:
        return (
            f"the first step's loss agrees within its floor{' (and its gradients)' if d.grads_checked else ''}, later "
            f'losses or the final state do not: {later}; the first step, recorded module by module, parts '
            f'earlier, in the {d.placed} (where: below)' + also
        )
    if d.kind is Finding.OPTIMIZER:
        return (
            "the first step's loss and gradients agree within their floor, the state after training does not: "
            f'{later}; the optimizer, its settings or its state differ' + also
        )
    return (
        f"the first step's loss agrees within its floor, later losses or the final state do not: {later}; "
        'the update differs (the optimizer, its state, or a gradient the loss does not show)' + also
    )


def describe(leaf: LeafDiff) -> str:
    limit = f'allowed {leaf.limit:.2e}' if leaf.limit is not None else 'outside the fixed tolerance'
    return f'{leaf.name} by {leaf.max_abs:.2e}, {limit}'


def details(leaves: list[LeafDiff], n: int = 3) -> str:
    shown = '; '.join(describe(leaf) for leaf in leaves[:n])
    return shown + (f'; and {len(leaves) - n} more' if len(leaves) > n else '')


def bookkeeping(sided: list[LeafDiff]) -> str:
    """The leaves on one side only, by group and side (a few named, the rest counted), and what to do."""
    by: dict[tuple[str, str], list[LeafDiff]] = {}
    for leaf in sided:
        by.setdefault((leaf.group, leaf.one_sided), []).append(leaf)
    parts = []
    for (group, side), leaves in by.items():
        some = ', '.join(leaf.name for leaf in leaves[:SHOWN]) + (
            f' and {len(leaves) - SHOWN} more' if len(leaves) > SHOWN else ''
        )
        parts.append(
            f'{len(leaves)} {group} leaves only on the {side} side ({some})'
            if len(leaves) > 1
            else f'{some} only on the {side} side'
        )
    fix = "map the field (the port's legacy_groups / new_groups), or keep it on both sides"
    if {group for group, _ in by} == {'opt_state'} and len({side for _, side in by}) == 2:
        fix = (
            'the two optimizer states have other structures (optax.chain(clip, adam) on one side, a bare adam '
            'on the other, say): build the same transformation on both sides, or map them with legacy_groups / '
            'new_groups'
        )
    elif any(group == 'ema' for group, _ in by):
        fix += '; an EMA is read from an nnx.Module or a params tree under ema, ema_params or params_ema'
    return f'{"; ".join(parts)}: nothing numeric differs here; {fix}'


def nonfinite(record: NonFinite | None) -> str:
    """Where the first NaN or Inf appeared, per side, and whether the data had it; '' when none did."""
    if record is None:
        return ''
    where = [f'{side} from step {s}' if s is not None else f'{side} in {leaf} (losses finite)'
             for side, s, leaf in record.where]  # fmt: skip
    d = record.data_step
    data = f'the data holds NaN or Inf at step {d}' if d else 'the data is finite (training diverged)'
    return f'non-finite values: {", ".join(where)}; {data}'
