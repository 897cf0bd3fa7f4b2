"""The verdict in English: every sentence the report says of a verdict, written from its typed values
(``verdict.rule.Verdict``, ``verdict.findings``). The verdict decides and records; only this module words it,
for the text and for the JSON's ``verdict`` fields alike.
"""

from equivalence.core.report import reach
from equivalence.core.run import footprint
from equivalence.core.verdict import twin as twins
from equivalence.core.verdict.compare import LeafDiff
from equivalence.core.verdict.findings import (
    Diagnosis,
    Excess,
    Finding,
    Held,
    Hidden,
    LegacyTwin,
    Memory,
    NonFinite,
    NotRun,
    NoTwin,
    Probe,
    Probed,
    Refusal,
    Screen,
    Thin,
    TwinRefused,
    Twins,
    Unmeasured,
    Unrun,
)
from equivalence.core.verdict.rule import NOT_VERIFIED_SHARE, TWIN_ULPS, Verdict

SHOWN = 3  # leaves named per group and side; the rest counted

NOISE_HIDES = (
    "the run's own rounding (its twin) moves them by about as much as legacy differs, so a slip there would pass "
    'unseen; every leaf is within its floor, and that proves nothing here; more steps (--calls) move parameters '
    'that have barely left their initial values (a zero-initialised layer) beyond their noise'
)

# Why a twin on another device count computes otherwise, most often (diffusion_distillation's step, tried blind):
PER_REPLICA = (
    '; a new side whose arithmetic follows its device count (randomness or clipping per replica sized by the '
    "mesh) computes otherwise on the twin's devices: do it per group of rows for the pmap side's D "
    "(rng_modes=('per-device',), step_form='state_rng'; docs/port.md#the-device-count), or measure the floor "
    "on the run's own program (--twin program, the default)"
)

SKIPS = {
    LegacyTwin.Skip.NO_COUNT: 'no second device count fits',
    LegacyTwin.Skip.ONE_CALL: 'with one call there is no early state to tell chaos from a real difference',
}

PROBES = {Probe.GRADS: 'first-step gradients', Probe.LEGACY_TWIN: 'legacy twin',
          Probe.RERUN: 'deterministic re-run (dropout off)',
          Probe.HELD: 'first step held module by module (noise-dominated leaves cannot verify)'}  # fmt: skip


def lines(v: Verdict) -> list[str]:
    """What the verdict measured, its noise-dominated leaves, why NOT VERIFIED, the diagnosis, where it parts."""
    out = [f'verdict: {v.mode}; ' + '; '.join(done(v))]
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
    return out + ([f'  {disagreement(v)}'] if v.location is not None and v.location.disagrees(v.kind) else [])


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


def step(record) -> str:
    if isinstance(record, Screen):
        return 'fixed screen passed' if record.passed else 'fixed screen not passed: the measured floor decides'
    if isinstance(record, NoTwin):
        return f'twin {twin(record)}'
    if isinstance(record, Twins):
        return (
            f'every leaf and the first loss held to the floor of {"twins" if len(record.kinds) > 1 else "a twin"} '
            + twin(record)
        )
    if isinstance(record, Memory):
        return footprint.line(record.run, record.twins)
    if isinstance(record, Probed):
        said = ('agree', 'differ') if record.probe is Probe.GRADS else ('matches', 'differs')
        return f'{PROBES[record.probe]} {said[0] if record.agree else said[1]}'
    if isinstance(record, NotRun):
        return f'{PROBES[record.probe]} {"not probed" if record.probe is Probe.GRADS else "not run"}: {record.why}'
    if isinstance(record, LegacyTwin):
        return legacy_twin(record)
    if isinstance(record, Held):
        return held(record)
    raise TypeError(f'no words for {record!r}')


def twin(record: Twins | NoTwin | None) -> str:
    """The verdict's ``twin``: where the floor's twins ran ('on 1 device(s)'), or why there is no floor."""
    if record is None:
        return ''
    if isinstance(record, NoTwin):
        if record.why is NoTwin.Why.NO_MESH:
            return f'not run: no second mesh fits ({record.detail or "an odd batch"})'
        if record.why is NoTwin.Why.SCREEN_PASSED:
            return 'not run: --verdict screen, and the screen passed'
        return reason(record.detail)
    on = twins.describe(list(record.kinds))
    on += f' in each of {record.processes} processes' if record.processes > 1 else ''
    if record.fresh:
        some = f' ({" and ".join(map(str, record.fresh))} of them)' if len(record.fresh) < len(record.kinds) else ''
        on += f' in a fresh process{some}'
    return on


def reason(detail) -> str:
    """Why one twin measures no floor: it did not run (``Unrun``), or it was refused (``TwinRefused``)."""
    if isinstance(detail, Unrun):
        return unrun(detail)
    if not isinstance(detail, TwinRefused):
        return detail
    said = refusal(detail.refusal)
    if detail.refusal.why is Refusal.Why.OWN_NON_FINITE:  # the run's own program
        return f'{said} ({detail.kind})'
    said += PER_REPLICA if detail.per_replica else ''
    return f'{said} ({twins.describe([detail.kind])}{" in a fresh process" if detail.fresh else ""})'


def unrun(d: Unrun) -> str:
    on = twins.describe([d.kind])
    if d.ratio is not None:
        return f"not run {on}: it would hold {d.ratio:.2f}x the run's bytes per device"
    if d.own:
        return f'not run: {d.kind} raised {d.raised}'
    said = f'{d.kind} device(s) are more than this process sees' if d.raised is None else f'{on} it raised {d.raised}'
    return f'not run: {said}; ' + (f'and no fresh process: {d.no_fresh}' if d.no_fresh else d.fresh_raised)


def refusal(r: Refusal) -> str:
    """Why a twin is refused as a floor."""
    why = Refusal.Why
    if r.why is why.NON_FINITE:
        return f'refused: a non-finite loss at step {r.step} ({r.side.lower()} {r.run}, twin {r.twin})'
    if r.why is why.SPACINGS:
        return (
            f'refused: its loss at step {r.step} is {r.spacings:.0f} float32 spacings from the {r.side} run '
            f'({r.twin:.9g} vs {r.run:.9g}, more than {TWIN_ULPS:g}): it does not compute the same thing, '
            'so it measures no floor'
        )
    if r.why is why.SAME_ORDER:
        return "refused: it ended in bitwise the new side's state: it summed the gradients in the same order, no floor"
    if r.why is why.OWN_NON_FINITE:
        return f"refused: its loss at step {r.step} is {r.twin}, the run's {r.run}"
    if r.why is why.ANY_NON_FINITE:
        return 'refused: a non-finite loss'
    if r.why is why.EARLY:
        return f'refused: after the first call, {excess(r.excess)}: on another count it computes something else'
    return r.detail  # DRAWS: the run room's words on the draws


def excess(e: Excess) -> str:
    return f'params/{e.path} {e.spread:.2e} from the legacy run (allowed {e.limit:.2e})'


def legacy_twin(record: LegacyTwin) -> str:
    on, ran = f'legacy twin on {record.devices} device(s)', LegacyTwin.Ran
    if record.ran is ran.NOT_RUN and isinstance(record.why, Excess):
        return (
            f'legacy twin not run: NNX is off after the first call, {excess(record.why)}: not chaos, which grows '
            'from rounding'
        )
    if record.ran is ran.NOT_RUN:
        return f'legacy twin not run: {SKIPS.get(record.why, record.why)}'
    if record.ran is ran.RAISED:
        return f'{on} not run: it raised {record.why}'
    if record.ran is ran.REFUSED:
        return f'{on} {refusal(record.why) if isinstance(record.why, Refusal) else record.why}'
    keys = f", drawing with the run's {record.rows} per-device keys" if record.rows else ''
    return f"a {on}{keys} measured the pmap side's own floor"


def held(record: Held) -> str:
    if not record.reproduced:
        said = 'first step not held module by module: its recording does not reproduce the run'
    elif record.part is None:
        said = f'first step held module by module: {record.calls} module calls within their floors'
    else:
        said = ('first step held module by module (noise-dominated leaves cannot verify): '
                f'{record.part[0]} at {record.part[1]} parts')  # fmt: skip
    if record.whole_failed:
        return f'{said} (in the forward pass alone: the whole step could not be recorded)'
    if record.alone is not None:
        a = record.alone
        alone = f'{a.path.removeprefix("forward/")} by {a.max_abs:.2e}, allowed {a.limit:.2e}'
        return f'{said} (the forward pass alone, another program, parted at {alone}: its own rounding)'
    return said


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
