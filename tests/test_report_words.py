"""The report's own words (``core/report/words``): each typed value of a verdict said as the report says it.

The other tests assert the verdict's typed values (its outcome, ``Finding``, records of what it did); the
sentences a user reads are held here, once, from those values. No JAX runs.
"""

import numpy as np

from equivalence.core.compare.compare import LeafDiff
from equivalence.core.compare.findings import (
    Diagnosis,
    Excess,
    Finding,
    Held,
    Hidden,
    LegacyTwin,
    NonFinite,
    NotRun,
    NoTwin,
    Probe,
    Probed,
    Refusal,
    Screen,
    TwinRefused,
    Twins,
    Unmeasured,
    Unrun,
)
from equivalence.core.compare.outcome import Outcome
from equivalence.core.compare.rule import Verdict
from equivalence.core.report import words
from equivalence.core.run.model_side import Reordered

LOSS = LeafDiff('first_step', 'loss', 3e-5, 3e-5, False, floor=1e-7, limit=1e-6)
KERNEL = LeafDiff('params', 'hidden/kernel', 2.5e-5, 1e-3, False, floor=6e-8, limit=6e-7)
STEP = LeafDiff('step', 'step', np.inf, np.inf, False, 'only on the new side', one_sided='new')


def test_each_step_the_verdict_took_is_said_in_order():
    verdict = Verdict(Outcome.MISMATCH, 'measured', (
        Screen(passed=False),
        Twins((1, 8)),
        NoTwin(NoTwin.Why.TWIN, 'refused: its loss at step 2 is 40 float32 spacings from the new run'),
        Probed(Probe.GRADS, agree=True),
        NotRun(Probe.RERUN, 'several processes'),
        NotRun(Probe.GRADS, 'resumed from a checkpoint'),
        LegacyTwin(LegacyTwin.Ran.MEASURED, 1, rows=8),
        LegacyTwin(LegacyTwin.Ran.NOT_RUN, why=LegacyTwin.Skip.ONE_CALL),
        LegacyTwin(LegacyTwin.Ran.RAISED, 2, 'ValueError: boom'),
        Probed(Probe.RERUN, agree=True),
        NotRun(Probe.HELD, 'several processes'),
    ))  # fmt: skip
    assert words.done(verdict) == [
        'fixed screen not passed: the measured floor decides',  # not a failure: a MATCH says it too
        'every leaf and the first loss held to the floor of twins on 1 and 8 device(s)',
        'twin refused: its loss at step 2 is 40 float32 spacings from the new run',
        'first-step gradients agree',
        'deterministic re-run (dropout off) not run: several processes',
        'first-step gradients not probed: resumed from a checkpoint',
        "a legacy twin on 1 device(s), drawing with the run's 8 per-device keys measured the pmap side's own floor",
        'legacy twin not run: with one call there is no early state to tell chaos from a real difference',
        'legacy twin on 2 device(s) not run: it raised ValueError: boom',
        'deterministic re-run (dropout off) matches',
        'first step held module by module (noise-dominated leaves cannot verify) not run: several processes',
    ]


def test_where_the_twins_ran_or_why_none_did():
    assert words.twin(Twins((2,))) == 'on 2 device(s)'
    assert words.twin(Twins((1,), fresh=(1,))) == 'on 1 device(s) in a fresh process'
    assert words.twin(Twins((1,), processes=2)) == 'on 1 device(s) in each of 2 processes'
    placed = Twins((Reordered('fsdp'), Reordered('fsdp-tp')))
    assert (
        words.twin(placed) == "on the run's devices: fsdp, batch rows interleaved and fsdp-tp, batch rows interleaved"
    )
    assert words.twin(NoTwin(NoTwin.Why.NO_MESH)) == 'not run: no second mesh fits (an odd batch)'
    assert words.twin(NoTwin(NoTwin.Why.SCREEN_PASSED)) == 'not run: --verdict screen, and the screen passed'


def test_the_diagnosis_line_of_each_finding():
    assert words.diagnosis(Diagnosis(Finding.MATH, (LOSS,))) == (
        'the first step already differs beyond its floor, before any update: first_step/loss by 3.00e-05, '
        'allowed 1.00e-06'
    )
    assert words.diagnosis(Diagnosis(Finding.RANDOMNESS, (LOSS,))).startswith(
        "the first step's loss differs (first_step/loss by 3.00e-05, allowed 1.00e-06), but with dropout off"
    )
    assert words.diagnosis(Diagnosis(Finding.BOOKKEEPING, sided=(STEP,))).startswith(
        'step/step only on the new side: nothing numeric differs here; map the field'
    )
    optimizer = words.diagnosis(Diagnosis(Finding.OPTIMIZER, (KERNEL,), (STEP,), grads_checked=True))
    assert optimizer.startswith("the first step's loss and gradients agree within their floor")
    assert optimizer.endswith('the optimizer, its settings or its state differ (also: step/step only on the new side: '
                              "nothing numeric differs here; map the field (the port's legacy_groups / new_groups), "
                              'or keep it on both sides)')  # fmt: skip
    placed = words.diagnosis(Diagnosis(Finding.MATH, (KERNEL,), grads_checked=True, placed='forward'))
    assert 'agrees within its floor (and its gradients), later' in placed and placed.endswith(
        'in the forward (where: below)'
    )
    unmeasured = Diagnosis(Finding.UNMEASURED, (KERNEL,), no_floor=NoTwin(NoTwin.Why.NO_MESH, 'one device'))
    assert words.diagnosis(unmeasured).endswith('no twin measured one: not run: no second mesh fits (one device)')
    nan = NonFinite((('legacy', 3, None), ('new', None, 'params/w')), data_step=3)
    assert words.diagnosis(Diagnosis(Finding.NON_FINITE, nonfinite=nan)) == (
        'non-finite values: legacy from step 3, new in params/w (losses finite); the data holds NaN or Inf at step 3'
    )


def test_not_verified_says_why_and_the_lines_say_what_it_means():
    noisy = tuple(LeafDiff('params', f'l{i}/bias', 1e-3, 1.0, True, floor=1e-3, noise_dominated=True) for i in range(5))
    hidden = Hidden(0.42, noisy, noisy[:1], losses=True)
    assert words.unverified(hidden) == (
        '42.0% of the parameters are noise-dominated (params/l0/bias, params/l1/bias, params/l2/bias and 2 more), '
        'more than 10%; the output layer is noise-dominated (params/l0/bias); the per-step losses are noise-dominated'
    )
    lines = words.lines(Verdict(Outcome.NOT_VERIFIED, 'measured', (Screen(True),), unverified=hidden))
    assert lines[0] == 'verdict: measured; fixed screen passed'
    assert lines[1].startswith('not verified: 42.0% of') and lines[1].endswith(words.NOISE_HIDES)
    unmeasured = Unmeasured(NoTwin(NoTwin.Why.NO_MESH), screen_passed=True)
    assert words.unverified(unmeasured) == (
        "no twin measured this port's noise floor (not run: no second mesh fits (an odd batch)); the fixed screen "
        "passed, which is not a measure of this port's own noise"
    )
    assert words.unverified(None) == ''


def test_the_first_step_held_module_by_module():
    assert words.held(Held(reproduced=False)).endswith('its recording does not reproduce the run')
    assert words.held(Held(calls=22)) == 'first step held module by module: 22 module calls within their floors'
    part = Held(calls=22, part=('module', 'attn/out'))
    assert words.held(part).endswith(': module at attn/out parts')
    seen = LeafDiff('first_step', 'forward/attn/out/output', 2.15e-6, 2.15e-6, False, limit=1.91e-6)
    assert words.held(Held(calls=22, alone=seen)).endswith(
        '(the forward pass alone, another program, parted at attn/out/output by 2.15e-06, allowed 1.91e-06: its own '
        'rounding)'
    )
    assert words.held(Held(calls=22, part=('module', 'attn/out'), whole_failed=True)).endswith(
        '(in the forward pass alone: the whole step could not be recorded)'
    )


def test_why_a_twin_is_refused():
    spacings = Refusal(Refusal.Why.SPACINGS, 2, 2.5, 2.5001, 40.0)
    assert words.refusal(spacings) == (
        'refused: its loss at step 2 is 40 float32 spacings from the new run (2.5001 vs 2.5, more than 8): it does '
        'not compute the same thing, so it measures no floor'
    )
    assert words.refusal(Refusal(Refusal.Why.NON_FINITE, 1, 2.5, float('nan'), side='legacy')) == (
        'refused: a non-finite loss at step 1 (legacy 2.5, twin nan)'
    )
    other = Refusal(Refusal.Why.DRAWS, detail='refused: it draws other random numbers')
    drawn = TwinRefused(1, other, per_replica=True)
    said = words.twin(NoTwin(NoTwin.Why.TWIN, drawn))
    assert said.startswith('refused: it draws other random numbers; a new side whose arithmetic follows its device')
    assert 'docs/port.md#the-device-count' in said and said.endswith('(on 1 device(s))')
    early = Excess('w', 1e-5, 1.91e-6)
    assert words.legacy_twin(LegacyTwin(LegacyTwin.Ran.NOT_RUN, why=early)) == (
        'legacy twin not run: NNX is off after the first call, params/w 1.00e-05 from the legacy run (allowed '
        '1.91e-06): not chaos, which grows from rounding'
    )
    refused = LegacyTwin(LegacyTwin.Ran.REFUSED, 1, Refusal(Refusal.Why.EARLY, side='legacy', excess=early))
    assert words.legacy_twin(refused) == (
        'legacy twin on 1 device(s) refused: after the first call, params/w 1.00e-05 from the legacy run (allowed '
        '1.91e-06): on another count it computes something else'
    )


def test_why_a_twin_did_not_run():
    assert words.reason(Unrun(1, None, no_fresh='several processes')) == (
        'not run: 1 device(s) are more than this process sees; and no fresh process: several processes'
    )
    assert words.reason(Unrun(1, 'ValueError: pinned', fresh_raised='RuntimeError: exited 1')) == (
        'not run: on 1 device(s) it raised ValueError: pinned; RuntimeError: exited 1'
    )
    too_big = words.reason(Unrun(8, ratio=1.46))
    assert too_big == "not run on 8 device(s): it would hold 1.46x the run's bytes per device"


def test_a_diagnosis_that_disagrees_with_where_is_said_under_it():
    from equivalence.core.compare.location import Location

    module = Location('module', 'LayerNorm_0', 'norm', 'it computes something else')
    said = words.lines(Verdict(Outcome.MISMATCH, 'measured', diagnosis=Diagnosis(Finding.RANDOMNESS, (LOSS,)),
                               location=module))  # fmt: skip
    assert said[-2].startswith('where: module at LayerNorm_0') and said[-1] == (
        '  the diagnosis (randomness) and where: (module) disagree: where: holds the first step to its floors, the '
        'diagnosis reads the leaves after training'
    )
    agreeing = Verdict(Outcome.MISMATCH, 'measured', diagnosis=Diagnosis(Finding.MATH, (LOSS,)), location=module)
    assert words.lines(agreeing)[-1].startswith('where: module')  # the control: no such line


def test_the_first_screen_says_the_place_its_step_and_cause_in_lines_of_100():
    """The short where: of a warmup's slip keeps the step it parts on and what the update's size implies; a loss
    term's place names the term; each line is at most ``screen.WIDTH`` characters, wrapped, not cut."""
    import types

    from equivalence.core.compare.location import Location, read
    from equivalence.core.report import screen

    def said(location: Location) -> list[str]:
        v = Verdict(Outcome.MISMATCH, 'measured', location=location)
        return [x for line in screen.where(types.SimpleNamespace(verdict=v)) for x in screen.fit(line)]

    warmup = Location('update', 'the update rule', 'the update rule', '', read=read(
        step=2, exact=True, first_update_zero=True, update='step factor', update_factor=0.8))  # fmt: skip
    lines = said(warmup)
    assert lines[0].startswith("where: on step 2 (nothing parts before it; step 1's update is 0, as warmup gives)")
    assert 'a learning rate, a schedule value' in ' '.join(x.strip() for x in lines)
    assert all(len(x) <= screen.WIDTH for x in lines)
    for seen in ('agree', 'not observed'):  # a loop port's gradients are its own step's: never said to agree
        step = Location('update', 'the update rule', 'the update rule', '', read=read(gradients=seen))
        assert ('the gradients agree' in said(step)[0]) == (seen == 'agree'), said(step)
    term = Location('loss', 'loss term losses/distortion', 'loss term losses/distortion', '',
                    read=read(parts='loss term', terms=('losses/distortion',)))  # fmt: skip
    assert said(term)[0].startswith('where: the loss term losses/distortion: it parts, the other terms agree')


def test_the_first_screen_counts_what_is_not_compared_in_one_line():
    """A NeRF step's 148 metrics on one side only were 148 'not compared' lines above the loss table: the first
    screen says their count and kinds in one line (``--verbose`` and the JSON's ``notes`` list each)."""
    import types

    from equivalence.core.report import screen
    from equivalence.core.state.states import Skip, Uncompared

    many = [Uncompared(f'metrics/m{i}', Skip.ONE_SIDE, 'only one side reports it') for i in range(148)]
    notes = screen.notes(types.SimpleNamespace(notes=[*many, 'the pmap side read from the reference r.npz']))
    assert len(notes) == 2 and notes[1] == 'the pmap side read from the reference r.npz', notes
    assert notes[0].startswith('not compared: 148 fields and metrics (one side;'), notes
    few = screen.notes(types.SimpleNamespace(notes=many[:2]))
    assert few == many[:2]
