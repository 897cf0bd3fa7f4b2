"""``where:`` on the shapes of slip it placed wrong in ports nobody here wrote (issue 40), each on the
mlp example's loop port with an EMA (``where_ports.py``): the kind it names and the figures that say
so, and the correct port (the negative control) located nowhere. A wrong place is worse than none:
the NaN batch is not located at all."""

import dataclasses
import functools
import os
import re
import types

import numpy as np
import optax
import pytest
import where_ports as wp
from conftest import require_devices
from where_ports import my_port

from equivalence.core import harness, kinds
from equivalence.core.compare import compare
from equivalence.core.compare import rule as verdict
from equivalence.core.compare.findings import Finding, Held
from equivalence.core.compare.location import Unplaced
from equivalence.core.compare.outcome import Outcome
from equivalence.core.locate import hidden, locate
from equivalence.core.locate.first_step import Recorder
from equivalence.core.port.config import RunConfig
from equivalence.core.port.naming import PortError
from equivalence.core.report import plots, render, words
from equivalence.core.run import inputs as made
from equivalence.core.run import nudge


@functools.cache
def checked(name: str):
    require_devices(2)
    twin = 'devices' if name in wp.DEVICE_TWIN else 'program'
    return harness.check(wp.PORTS[name], devices=2, steps_per_call=2, calls=2, locate=True, twin=twin)


def located(name: str):
    result = checked(name)
    return result.outcome.label, result.verdict.location


@pytest.mark.parametrize(
    'name, kind, figures',
    [
        # The negative control: the same loop with the same EMA, nothing parts, no place is named.
        ('correct', 'none', ['nothing parts']),
        # Only ema/ parts: the EMA, with the decay each side's update implies.
        ('ema-rate', 'ema', [r'pmap 0\.99, new 0\.(9|8999)']),
        # A Python float against a float32 leaf: the same decay, the arithmetic differs.
        ('ema-python-float', 'ema', [r'pmap 0\.99, new 0\.99 \(the same decay']),
        # SGD momentum under a warmup whose first update is 0: its slot on step 2, not the gradients.
        ('momentum-under-warmup', 'update', ['on step 2', '0/trace']),
        # Its learning rate 10 x: the step, not the gradients, which the momentum slot holds alike (a ViT's,
        # tried blind, read '..., or a gradient scale' beside 'every optimizer slot agree').
        ('lr-under-warmup', 'update', ['on step 2', r'steps 10 x', 'not a gradient scale: the first moments agree']),
        # A weight decay added after the learning-rate scale, masked to the kernels.
        ('decay-after-lr', 'update', [r'-0\.01 x the parameter on the kernels']),
        # The pmap step's own collectives: a loss each device reports alone, gradients not averaged.
        ('loss-not-pmeaned', 'collective', ['its reported loss', 'differs from device to device']),
        ('grads-not-pmeaned', 'collective', ['its gradients', 'missing_pmean']),
        # NaN in the data: both sides go non-finite; no module is to blame.
        ('nan-data', Unplaced.DATA_NOT_FINITE, ['the batch of step 4 holds NaN']),
        # A step's own random draws (noisy inputs from each device's key), compared by what they are drawn
        # from: equal on the correct port (nothing parts); a key folded otherwise is the draws, not the code
        # that feeds the first layer; the examples given other devices' noise part example by example: not
        # located (it was 'between', the code that feeds it).
        ('noise-correct', 'none', ['nothing parts']),
        ('noise-key-folded', 'randomness', ["the step's own random draws", r'(\d+) of the \1 random draws']),
        ('noise-rows-interleaved', Unplaced.BY_EXAMPLE, [r'\d+ of its 16 examples agree']),
        # Biases before BatchNorm, noise-dominated with their Adam slots, do not hide the update rule (issue 60:
        # 'not located: on step 4 module at conv1 parts, but ... conv2/bias 1.01e-03 apart'; the clip's 'nothing
        # parts on steps 1 to 4', the twin's floor pooled over those leaves allowing every slot 10x its scale).
        ('bn-bias-warmup', 'update', ['on step 2', 'a learning rate or schedule value that differs']),
        ('bn-bias-clip', 'update', [r'1/0/mu', r'NNX = 0\.5 x pmap']),
    ],
)
def test_where_names_the_stage_that_parts_or_nothing(name, kind, figures):
    outcome, loc = located(name)
    assert outcome == ('MATCH' if name.endswith('correct') else 'MISMATCH'), (name, outcome)
    assert loc is not None and (loc.why or loc.kind) == kind, (name, loc and loc.line())  # why: when unlocated
    for figure in figures:  # regular expressions: a decay fitted in float64 to float32 arithmetic
        assert re.search(figure, loc.line()), (name, figure, loc.line())


def test_the_pictures_show_the_floors_the_failed_leaves_and_the_stage_that_parts(tmp_path):
    """The EMA-rate slip's pictures (issue 40: the divergence picture drew the fixed screen's atol, under
    which every point of a MISMATCH sat, and the location picture marked nothing): the leaves' measured
    limits with the failed ones named, the loss difference against its allowed line, and the stage strip
    with the EMA marked, every stage the verdict's leaves rule out said so."""
    result = checked('ema-rate')
    loc = result.verdict.location
    assert {'forward', 'update'} <= set(loc.ruled_out) and 'ema' not in loc.ruled_out, loc
    leaves = result.report.leaves
    failed = {x.name for x in leaves if not x.ok}
    assert failed and all(name.startswith('ema/') for name in failed), failed
    figure = plots.divergence_figure(result.param_divergence(), 2, leaves, 'MISMATCH', screen=(1e-6, 1e-6))
    named = {t.get_text() for t in figure.axes[1].texts}
    assert named and named <= failed, (named, failed)
    assert figure.axes[1].get_title().startswith(f'{len(failed)} of ')
    losses = next(x for x in leaves if x.group == 'losses')
    figure = plots.losses_figure(result.legacy.losses, result.new.losses, 2, 'MISMATCH', leaf=losses)
    assert figure.axes[1].get_yscale() == 'log'
    assert any(list(line.get_ydata()[:1]) == [losses.limit] for line in figure.axes[1].lines)  # its allowed line
    strip = plots.location_figure(loc, 'where').axes[0]
    said = [t.get_text() for t in strip.texts]
    assert said[said.index('ema') + 1] == 'parts here' and said[said.index('update') + 1].startswith('ruled out')
    written = plots.write(result, str(tmp_path))
    assert [os.path.basename(p) for p in written] == list(plots.FILES) and all(os.path.getsize(p) for p in written)


def test_an_ema_only_difference_is_diagnosed_as_the_ema():
    """Only ema/ leaves outside their floors (an EMA decay slip): the diagnosis is the EMA, in the verdict and
    in the report's JSON, not 'the update differs' (issue 51, diffusion_distillation's EMA-rate slip); a slip
    that parts the parameters too stays the update's."""
    result = checked('ema-rate')
    assert {x.group for x in result.report.leaves if not x.ok} == {'ema'}
    assert result.verdict.kind is Finding.EMA and render.verdict_json(result)['kind'] == 'ema', result.verdict
    assert checked('decay-after-lr').verdict.kind is Finding.UPDATE


def test_a_match_whose_parameters_are_noise_dominated_is_held_module_by_module_on_the_first_step():
    """A MATCH with noise-dominated parameters proves nothing of them (score_sde's DDPM hid a changed time
    embedding behind its zero-initialised output convolution: every leaf within its floor, exit 0): its
    first step is held module by module. The mlp example's LayerNorm epsilon slip, recorded as the verdict
    records it, gives one failing leaf at the LayerNorm; the correct loop gives none (the negative control)."""
    require_devices(2)
    for port, parts in ((my_port.LOOP, None), (my_port.LOOP_EPSILON_SLIP, 'norm')):
        config = RunConfig(workload=port.name, devices=2, steps_per_call=1, calls=1, batch_size=port.default_batch,
                           rng_mode=port.rng_modes[0])  # fmt: skip
        kind, fed = kinds.of(port), made.make(port, config)
        seen = locate.Seen(noisy=frozenset({'fc1/bias'}))  # as if the verdict found it noise-dominated
        leaves, said = hidden.first_step_leaves(Recorder(kind, config, fed, 1), seen)
        if parts is None:
            assert leaves == [] and said.reproduced and said.part is None and said.calls > 0, said
        else:
            assert [(x.group, x.path, x.ok) for x in leaves] == [('first_step', f'forward/{parts}/output', False)]
            assert leaves[0].max_abs > leaves[0].limit, leaves


def test_a_part_seen_in_the_forward_pass_alone_needs_the_whole_steps_recording_to_fail_a_match(monkeypatch):
    """The forward pass compiled alone is another program and rounds otherwise: score_sde_port at D = 8, correct,
    parted there at attn/out by 2.15e-06 (8 spacings allowed, 9 apart), a MISMATCH on a correct port, while
    the whole step's recording held every module call within its floor. So a part seen there is held again on
    the whole step's recording, which decides: no leaf where it agrees (said, with the forward pass's figures),
    the leaf where it parts too (the negative control: the test above, and test_recording's slips, through
    the real recordings). The rule alone here: each recording's judgement given."""
    part = compare.LeafDiff('first_step', 'forward/attn/out/output', 2.15e-6, 2.15e-6, False, size=1, bad=1,
                            floor=0.0, limit=1.91e-6)  # fmt: skip
    forward, whole = ('forward',), ('whole',)
    for whole_parts in (False, True):
        judged = {forward: [part], whole: [part] if whole_parts else []}

        def held(recorder, runs, seen, judged=judged):
            return judged[runs], Held(calls=22, part=('module', 'attn/out')) if judged[runs] else Held(calls=22)

        monkeypatch.setattr(hidden, '_held', held)
        recorder = types.SimpleNamespace(forward=forward, runs=whole, recorded_whole=False)
        leaves, said = hidden.first_step_leaves(recorder, locate.Seen(noisy=frozenset({'attn/k/bias'})))
        if whole_parts:
            assert leaves == [part] and said == Held(calls=22, part=('module', 'attn/out')), said
        else:  # nothing parts on the whole step; the forward pass alone's part is kept, with its figures
            assert leaves == [] and said == Held(calls=22, alone=part), said

    class Unrecordable:  # the whole step cannot be recorded: the part seen stands, and the words say where it was seen
        forward, recorded_whole = ('forward',), False

        @property
        def runs(self):
            raise RuntimeError('host work inside the step')

    leaves, said = hidden.first_step_leaves(Unrecordable(), locate.Seen(noisy=frozenset({'attn/k/bias'})))
    assert leaves == [part] and said == Held(calls=22, part=('module', 'attn/out'), whole_failed=True), said


def test_optimizer_states_of_another_structure_are_a_port_error_before_training():
    """A new side whose optax chain wraps the same Adam in another structure (clip first): no leaf of the two
    optimizer states pairs, and every one was compared on one side only, a MISMATCH of bookkeeping with
    'where: update at opt_state 0/count' (a place, with '-' for its figures). It is the port's reading,
    said before training (exit 2), with the fix; the same chain on both sides is no error (the control). So is
    a state whose slots differ in part."""
    require_devices(2)
    chain = optax.chain(optax.clip_by_global_norm(1e9), wp.legacy_tx())
    with pytest.raises(PortError, match=r'another structure .* pmap side holds 0/count, 0/mu, 0/nu, the new side '
                                        r'1/0/count, 1/0/mu, 1/0/nu'):  # fmt: skip
        harness.check(wp.port('chain', new_tx=chain), devices=2, steps_per_call=1, calls=1, diagnose=False)
    same = harness.check(wp.port('chain-both', tx=chain), devices=2, steps_per_call=1, calls=1, diagnose=False)
    assert same.outcome.label == 'MATCH', same.outcome
    # Slots that differ in part: a schedule's count on the new side only (optax.adam(schedule) against a float
    # learning rate; google-research/vdm's port was a bookkeeping MISMATCH, exit 1, after the whole run).
    scheduled = optax.adam(optax.constant_schedule(3e-3))
    with pytest.raises(PortError, match=r'slots are not the pmap side.s \(only on the new side: 1/count\)'):
        harness.check(wp.port('schedule', tx=optax.adam(3e-3), new_tx=scheduled), devices=2, steps_per_call=1,
                      calls=1, diagnose=False)  # fmt: skip


class _Leaf:
    def __init__(self, path, limit, ok=False, noise_dominated=False):
        self.path, self.limit, self.ok, self.noise_dominated = path, limit, ok, noise_dominated


class _Step:
    """What averages._carried and slots._later_slot read of a step: each side's final groups, the pmap
    side's optimizer state before it, the step judged, and no recorded gradients (a loop port's own step)."""

    def __init__(self, finals, step=2, prior=None):
        self.finals, self.step, self.prior, self.after = finals, step, prior, f'after step {step}'

    def final(self, side, group):
        return self.finals[side].get(group, {})

    def grads(self, side):
        return {}


def test_an_ema_that_carries_what_its_parameters_part_is_not_the_place():
    """score_sde's Adam eps, b1, clip and warmup slips were all 'ema at the EMA' (trials on fetched code,
    4 of 19 wrong): its parameters, noise-dominated, parted within their floors, and its EMA, held to a
    floor of its own, by (1 - d) x as much. One decay on both sides and nothing of the EMA's own: not the
    place. Controls: an EMA that parts beyond what its parameters carry (a rate kept in another precision),
    or whose parameters agree to the bit, is the EMA's own update."""
    from equivalence.core.locate import averages

    rng = np.random.default_rng(0)
    p, delta, d = rng.normal(size=16), 1e-4 * rng.normal(size=16), 0.99
    ema = lambda params, own=0.0: {'w': d * p + (1 - d) * params + own}  # noqa: E731
    leaf = [_Leaf('w', limit=1e-9)]
    carried = _Step(
        {'legacy': {'params': {'w': p}, 'ema': ema(p)}, 'new': {'params': {'w': p + delta}, 'ema': ema(p + delta)}}
    )
    assert 'by nothing of its own' in averages._carried(carried, leaf, [d, d])
    own = _Step(
        {
            'legacy': {'params': {'w': p}, 'ema': ema(p)},
            'new': {'params': {'w': p + delta}, 'ema': ema(p + delta, 1e-6)},
        }
    )
    assert averages._carried(own, leaf, [d, d]) == ''
    exact = _Step({'legacy': {'params': {'w': p}, 'ema': ema(p)}, 'new': {'params': {'w': p}, 'ema': ema(p, 1e-6)}})
    assert averages._carried(exact, leaf, None) == ''
    assert averages._carried(carried, leaf, [d, 0.999]) == ''  # two decays: the EMA's rate is the place
    assert averages._carried(carried, leaf, None) == 'no decay can be read here'


def test_a_slot_that_parts_on_a_later_step_is_the_optimizer_only_where_its_numbers_say_so():
    """imagenet's L2 penalty in the training loss, under SGD momentum and a warmup whose first update is 0,
    was 'update at opt_state 0/trace/...' on step 2 (trials on fetched code): the gradients are not observed,
    and a gradient that differs parts the trace as a momentum does. A momentum that differs parts it by a
    multiple of the trace before the step: located (the control); a difference of another shape: not located."""
    from equivalence.core.locate import slots

    rng = np.random.default_rng(1)
    before, g, p = rng.normal(size=32), rng.normal(size=32), rng.normal(size=32)
    path = '0/trace/fc1/kernel'
    leaves = {path: _Leaf(path, limit=1e-9)}
    trace = lambda m, extra=0.0: {'opt_state': {path: m * before + g + extra}}  # noqa: E731
    momentum = _Step({'legacy': trace(0.9), 'new': trace(0.95)}, prior={path: before})
    assert slots._later_slot(momentum, '0/trace', [path], leaves, 'not observed') is None
    l2 = _Step({'legacy': trace(0.9), 'new': trace(0.9, 4e-4 * p)}, prior={path: before})
    found = slots._later_slot(l2, '0/trace', [path], leaves, 'not observed')
    assert found is not None and found.why is Unplaced.GRADIENT_OR_SETTING, found
    assert (
        slots._later_slot(_Step(momentum.finals, step=1, prior={path: before}), '0/trace', [path], leaves, '') is None
    )


def test_each_module_call_is_allowed_what_the_runs_own_program_makes_of_a_one_spacing_difference():
    """A correct GroupNorm UNet's ModelPort failed on a GroupNorm 8.5 spacings apart, allowed 'floor 0.00e+00'
    and 8 spacings (issue 51): the device-count twin computes each example's forward pass as the run does,
    bitwise, so it measured nothing at a module, and the two programs' own rounding was read as a slip. The
    twin of the run's own program, its inputs one spacing off, moves every module call: each has a floor of
    its own. The control: the device-count twin leaves the module floors at 0."""
    require_devices(2)
    port = my_port.LOOP
    config = RunConfig(workload=port.name, devices=2, steps_per_call=1, calls=1, batch_size=port.default_batch,
                       rng_mode=port.rng_modes[0])  # fmt: skip
    kind, fed = kinds.of(port), made.make(port, config)
    floors = {}
    for twin in (nudge.DRAWS[0], 1):
        found = locate.judge_step(kind, *Recorder(kind, config, fed, twin).forward, fed.mapping, fed.variables)
        floors[twin] = [m.output_floor for m in found.modules]
    assert len(floors[1]) >= 4 and all(f is not None and f > 0 for f in floors[nudge.DRAWS[0]]), floors
    assert not all(f is not None and f > 0 for f in floors[1]), floors


def test_a_match_names_no_place_and_a_later_reading_defers_to_a_first_step_place():
    """A report never contradicts itself (issue 51): a MATCH located on request names no place, whatever its
    recording alone parts at (diffusion_distillation's correct loop: '105 module calls within their floors',
    MATCH, then 'where: module at up_1.attn_1/norm ... computes something else'); and a MISMATCH whose first
    gradients agree (a zero-initialised output hides every one of them) but whose first step parts in the
    forward pass is that math, not 'the optimizer ... differ'."""
    module = locate.Location('module', 'LayerNorm_0', 'norm', 'its output 2.15e-06 apart (allowed 1.91e-06)')
    said = locate.unconfirmed(module)
    assert said.why is Unplaced.MATCH_UNCONFIRMED and said.new == '' and said.legacy == ''
    assert locate.unconfirmed(locate.Location('none', '', '', 'nothing parts')).kind == 'none'
    ref, new = ({'params': {'w': np.full(3, x, np.float32)}} for x in (1.0, 1.1))
    off = compare.compare_to_floor(ref, new, new, verdict.MEASURED_FLOOR)  # the twin at the new side: a floor of 0
    assert verdict.diagnose(off, None, None, True).kind is Finding.OPTIMIZER
    assert verdict.diagnose(off, None, None, True, placed='forward').kind is Finding.MATH
    assert verdict.diagnose(off, None, None, False, placed='forward').kind is Finding.MATH


def test_the_diagnosis_never_contradicts_where_and_says_so_where_it_would():
    """A first loss that agrees with dropout off reads as randomness, unless the first step's records (both
    sides' draws held equal) place a computation: a LayerNorm's epsilon at D = 8 read 'randomness' beside
    'where: module at LayerNorm_0 ... epsilon 1e-06 <-> 1e-05'. Where a diagnosis and a place still disagree,
    the report says so under where: (and the JSON's ``disagree``)."""
    ref, new = (verdict.first_step_tree(loss=x) for x in (1.0, 1.001))
    early = compare.compare_to_floor(ref, new, new, verdict.MEASURED_FLOOR)  # the twin at the new side: floor 0
    assert verdict.diagnose(early, None, True, True).kind is Finding.RANDOMNESS
    assert verdict.diagnose(early, None, True, True, place='randomness').kind is Finding.RANDOMNESS
    for computed in ('module', 'between', 'loss', 'backward'):
        assert verdict.diagnose(early, None, True, True, place=computed).kind is Finding.MATH
    update = locate.Location('update', 'the update rule', 'the update rule', 'steps 0 x the pmap side')
    said = verdict.Verdict(Outcome.MISMATCH, 'measured', diagnosis=verdict.diagnose(early, None, None, True),
                           location=update)  # fmt: skip
    assert words.disagree(said) and f'  {words.disagreement(said)}' in words.lines(said)
    agreed = dataclasses.replace(said, location=locate.Location('module', 'Dense_0', 'fc1', 'computes else'))
    assert not words.disagree(agreed) and f'  {words.disagreement(agreed)}' not in words.lines(agreed)


def test_a_difference_in_a_reported_metric_alone_is_said_so_and_placed_nowhere():
    """Only a metric the steps report parts (google/mipnerf's port, tried blind, computed its clipped gradient norm as
    ``min(norm, max_norm)`` where upstream takes the norm of the clipped gradients: 9 float32 spacings at D = 4, no
    twin moves a clamped value), every parameter, slot and loss within its floor: the diagnosis says a reported
    metric differs, not 'the update differs', and ``where:`` names no stage, recording nothing. The controls: a
    parameter apart as well is the update; a MISMATCH with no group named is located as before."""
    ref, new = ({'params': {'w': np.ones(3, np.float32)}, 'metrics': {'clipped': np.float32(x)}} for x in (0.05, 0.06))
    only = compare.compare_to_floor(ref, new, new, verdict.MEASURED_FLOOR)  # the twin at the new side: a floor of 0
    diagnosed = verdict.diagnose(only, None, None, False)
    assert diagnosed.kind is Finding.METRICS and [leaf.name for leaf in diagnosed.leaves] == ['metrics/clipped']
    assert words.diagnosis(diagnosed).startswith('the losses, parameters and optimizer state agree within their')
    also = {**new, 'params': {'w': np.full(3, 2.0, np.float32)}}
    assert verdict.diagnose(compare.compare_to_floor(ref, also, also, verdict.MEASURED_FLOOR), None, None,
                            False).kind is Finding.UPDATE  # fmt: skip
    nothing_recorded = types.SimpleNamespace()  # the locator returns before it reads the recording
    found = locate.locate(None, None, types.SimpleNamespace(mapping={}), nothing_recorded,
                          locate.Seen(failed=frozenset({'metrics'})))  # fmt: skip
    assert found.why is Unplaced.METRICS_ONLY and found.kind == 'unlocated', found.line()
