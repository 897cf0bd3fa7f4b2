"""What the verdict measured, in words: each step it took (the screen, the twins and where they ran, the probes),
a twin refused or not run and why, the pmap side's own twin, the first step held module by module. ``words``
hands these on; this module words the ``findings`` records of the floors.
"""

from equivalence.core.compare.findings import (
    Excess,
    Held,
    LegacyTwin,
    Memory,
    NotRun,
    NoTwin,
    Probe,
    Probed,
    Refusal,
    Screen,
    TwinRefused,
    Twins,
    Unrun,
)
from equivalence.core.compare.rule import TWIN_ULPS
from equivalence.core.measure import footprint
from equivalence.core.twins import twin as twins

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


def parted(r: Refusal) -> str:
    """What a twin refused for what it computes computed otherwise: its loss, or a parameter after the first call."""
    if r.why is Refusal.Why.SPACINGS:
        return f"its loss at step {r.step} {r.twin:.9g}, the run's {r.run:.9g}"
    return f'after the first call, {excess(r.excess)}'


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
    expected = (Refusal.Why.SPACINGS, Refusal.Why.EARLY)  # what it computes, not a NaN
    if record.ran is ran.REFUSED and record.keys_of is not None and getattr(record.why, 'why', None) in expected:
        return (
            f'{on} not used as a floor, as expected: with per-device keys the pmap step there is handed '
            f"{record.devices} key(s), not the run's {record.keys_of}, and a step that draws from its device's key "
            f"computes another run there ({parted(record.why)}); the run's own twins measure the floor"
        )
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
