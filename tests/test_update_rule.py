"""``where:`` never says what the check's own evidence denies, on a NeRF-like step (``update_rule_ports``: a proposal
MLP and a NeRF MLP, per-device ray sampling, three loss terms returned as metrics, Adam with a delayed decay, the
gradients clipped by norm per MLP):

- the update rule is named only where the forward pass, the loss and the gradients agree on the first step (a relu
  for the density's softplus, its first loss apart, was 'the new side steps 0 x the pmap side': a difference that
  grows every call with the update is no place where the first step parts earlier), against a reference as with
  both sides;
- a loss term that parts alone is the place of a loss weight;
- a clip is named: by norm per sub-tree on one side and globally (or not at all) on the other, the moments part by
  one factor a sub-tree; by value, most elements that part hold one magnitude;
- and where the diagnosis and ``where:`` would disagree, the report says so.
"""

import dataclasses
import functools
import os
import types

import numpy as np
import pytest
import update_rule_ports as up
from conftest import ROOT, require_devices

from equivalence.core import harness
from equivalence.core.compare.location import Location, Unplaced, Where
from equivalence.core.locate import clipping, implied, stages
from equivalence.core.report import render
from equivalence.core.trend import systematic

REFERENCE = os.path.join(ROOT, 'tests', 'data', 'nerf_like_jax0.4.38.npz')  # CORRECT's pmap side, on jax 0.4.38


@functools.cache
def checked(name: str, devices: int = 2, per_group: bool = False, reference: bool = False):
    require_devices(2)
    port = (up.PER_GROUP if per_group else up.PORTS)[name]
    if reference:
        return harness.check(port, reference=REFERENCE, locate=True)
    return harness.check(port, devices=devices, steps_per_call=2, calls=2, locate=True)


def located(name: str, **how):
    result = checked(name, **how)
    return result.outcome.label, result.verdict.kind, result.verdict.location


@pytest.mark.parametrize(
    'name, kind, place, figures',
    [
        ('correct', 'none', '', ['nothing parts']),  # the negative control
        # One loss term's weight: that term parts, the other two agree.
        ('distortion-weight', 'loss', 'term losses/distortion', ['while losses/data and losses/interlevel agree']),
        # Per MLP on the pmap side, by the global norm on the new side: one factor a sub-tree, each MLP's norm one.
        ('clip-global', 'update', 'the gradient clipping', ['one factor per sub-tree', 'clipped by the global norm']),
        ('clip-none', 'update', 'the gradient clipping', ['one factor per sub-tree', 'not clipped to that norm']),
        ('clip-by-value', 'update', 'the gradient clipping', ['hold one magnitude on the new side', 'element-wise']),
        # Gradients that differ (the interlevel loss trains the NeRF too) are not read as a clip.
        ('interlevel-no-stop', 'backward', 'nerf_mlp/', ['the first moments part unevenly']),
    ],
)
def test_each_slip_is_placed_where_the_first_step_parts(name, kind, place, figures):
    outcome, diagnosis, loc = located(name)
    assert outcome == ('MATCH' if name == 'correct' else 'MISMATCH'), (name, outcome)
    assert loc.kind == kind and place in loc.new, loc.line()
    assert all(figure in loc.figures for figure in figures), loc.line()
    assert not loc.disagrees(diagnosis), (diagnosis, loc.line())


def test_the_places_read_as_values():
    term = located('distortion-weight')[2].reading
    assert (term['parts'], term['terms'], term['agreed_terms']) == (
        'loss term',
        ('losses/distortion',),
        ('losses/data', 'losses/interlevel'),
    )
    side, norm, other = located('clip-global')[2].reading['clip_norm']
    assert side == 'pmap' and other == pytest.approx(norm, rel=1e-3)  # one norm a sub-tree there, globally here
    assert located('clip-global')[2].reading['gradients'] == 'not observed'  # a loop port: its own step's
    assert located('clip-none')[2].reading['clip_norm'][2] > 10 * norm
    assert located('clip-by-value')[2].reading['clip'][0] == 'new'


@pytest.mark.parametrize('devices', [1, 2])
def test_a_forward_slip_whose_module_inputs_cannot_be_compared_is_not_the_update_rule(devices):
    """The relu under ``nnx.vmap``, 16 rays a group: the first loss parts (math), and the first step is not
    located (or placed in the forward pass, where its calls pair): never the update rule its zero steps suggest."""
    outcome, diagnosis, loc = located('relu-density', devices=devices, per_group=True)
    assert outcome == 'MISMATCH' and diagnosis == 'math', (outcome, diagnosis)
    assert loc.kind != Where.UPDATE and not loc.disagrees(diagnosis), loc.line()


def test_a_reference_of_another_jax_places_as_a_check_of_both_sides_does():
    """Against a reference recorded on jax 0.4.38 the clip by the global norm was 'the update rule: the new side
    steps 0.7885 x ...: a learning rate', where both sides run placed no such thing."""
    require_devices(2)
    both = located('clip-global')[2]
    outcome, _, against = located('clip-global', reference=True)
    assert outcome == 'MISMATCH' and (against.kind, against.new) == (both.kind, both.new), against.line()
    assert located('correct', reference=True)[0] == 'MATCH'  # the control


def test_a_trend_names_the_update_rule_only_where_the_first_step_agrees_before_it():
    nothing = Location('none', '', '', 'nothing parts')
    assert systematic.may_place(nothing, first_step_parts=False)
    assert not systematic.may_place(nothing, first_step_parts=True)  # the first loss parts: math
    for why in systematic.AGREED_BEFORE:
        assert systematic.may_place(nothing.unplaced('not located', why), False), why
    for why in (Unplaced.UNCOMPARED, Unplaced.BY_EXAMPLE, Unplaced.UNOBSERVED, Unplaced.GRADIENT_OR_SETTING,
                Unplaced.ONE_FACTOR, Unplaced.LOSS_OR_DECAY, Unplaced.NOT_REPRODUCED, Unplaced.RAISED):  # fmt: skip
        assert not systematic.may_place(nothing.unplaced('not located', why), False), why
    assert not systematic.may_place(Location('module', 'a', 'a', 'parts'), False)


def test_a_trend_whose_factor_differs_from_leaf_to_leaf_names_clipping():
    trend = lambda leaf, factor: systematic.Trend(leaf, 'update', 0.99, 1e-20, 64, factor, 0.0, 100.0, 1e-3, 2)  # noqa: E731
    one = systematic.location(systematic.Reading((trend('a', 0.1), trend('b', 0.11))), frozenset({2}))
    assert 'steps 1.1 x' in one.figures and 'clipping' not in one.figures and 'factors' not in one.reading
    spread = systematic.location(systematic.Reading((trend('a', 0.1), trend('b', -0.5))), frozenset({2}))
    assert 'differs from leaf to leaf' in spread.figures and 'a gradient clipping that differs' in spread.figures
    assert spread.reading['factors'] == (-0.5, 0.1)


def moments_of(old: dict, new: dict, allowed: float = 1e-12) -> implied.Moments:
    return implied.moments('mu', {f'0/mu/{k}': (0.1 * old[k], 0.1 * new[k], allowed) for k in old})


def test_one_factor_per_sub_tree_is_a_clip_by_norm_where_one_side_holds_one_norm_a_sub_tree():
    rng = np.random.default_rng(0)
    sizes = {'kernel': 24, 'bias': 8}
    raw = {f'{mlp}/layers/{i}/{leaf}': rng.normal(size=n) * scale
           for mlp, scale in (('prop', 0.1), ('nerf', 1.0)) for i in range(2) for leaf, n in sizes.items()}  # fmt: skip
    norm = lambda tree: np.sqrt(sum(float(v @ v) for v in tree.values()))  # noqa: E731
    clip = lambda tree, top: {k: v * min(1, top / norm(tree)) for k, v in tree.items()}  # noqa: E731
    per_mlp = {k: v for mlp in ('prop', 'nerf') for k, v in clip({k: v for k, v in raw.items() if k.startswith(mlp)},
                                                                  1e-3).items()}  # fmt: skip
    globally = moments_of(per_mlp, clip(raw, 1e-3))
    assert globally.subtrees.clipped == 'pmap' and globally.subtrees.global_same, globally.text
    assert [name for name, _ in globally.subtrees.factors] == ['nerf', 'prop']
    unclipped = moments_of(per_mlp, raw)
    assert unclipped.subtrees.clipped == 'pmap' and not unclipped.subtrees.global_same, unclipped.text
    # the controls: a scale per sub-tree with no norm held (no clip claimed); one factor a leaf (no sub-tree)
    scaled = moments_of(raw, {k: v * (2.0 if k.startswith('prop') else 0.5) for k, v in raw.items()})
    assert scaled.subtrees is not None and scaled.subtrees.clipped is None, scaled.text
    leaf = moments_of(raw, {k: v * (1.0 + i) for i, (k, v) in enumerate(raw.items())})
    assert leaf.subtrees is None and leaf.factor is None and not leaf.uneven, leaf.text


def test_a_clip_by_value_beside_a_clip_by_norm_is_read_from_the_elements_it_holds():
    rng = np.random.default_rng(1)
    g = {'a': rng.normal(size=200), 'b': rng.normal(size=50)}
    normed = {k: v * 0.01 for k, v in g.items()}  # every element scaled, as a clip by norm does
    g['a'][0], normed['a'][0] = 2.0, 0.5  # at the clip's magnitude on both sides: clipped, and parting nowhere
    found = clipping.by_value([(normed[k], np.clip(g[k], -0.5, 0.5), 1e-9) for k in g])
    assert found is not None and found[:2] == ('new', 0.5) and 0 < found[2] < found[3], found
    noisy = {k: v + 0.3 * rng.normal(size=v.shape) for k, v in g.items()}
    assert clipping.by_value([(g[k], noisy[k], 1e-9) for k in g]) is None  # gradients that differ: no clip


def step_with(metrics: dict[str, tuple[float, float, float]], loss: tuple[float, float, float]):
    """A judged step whose three sides (pmap, new, twin) report ``metrics`` and ``loss``."""
    results = {
        side: types.SimpleNamespace(losses=np.float32([loss[i]]),
                                    metrics={p: np.float32([v[i]]) for p, v in metrics.items()})
        for i, side in enumerate(('legacy', 'new', 'twin'))
    }  # fmt: skip
    return types.SimpleNamespace(results=results)


def test_the_loss_terms_are_those_reported_metrics_that_add_up_to_the_loss():
    terms = {'losses/data': (0.5, 0.5, 0.5), 'losses/reg': (0.25, 0.025, 0.025), 'psnr': (9.0, 8.0, 8.0)}
    parted, agreed = stages.terms(step_with({**terms, 'loss': (0.75, 0.525, 0.525)}, (0.75, 0.525, 0.525)))
    assert [leaf.path for leaf in parted] == ['losses/reg'] and agreed == ['losses/data']
    # the controls: metrics that do not add up to the loss are no terms of it; every term parting names none
    assert stages.terms(step_with({'a': (0.5, 0.5, 0.5), 'b': (0.3, 0.2, 0.2)}, (0.75, 0.7, 0.7))) is None
    both = {'losses/data': (0.5, 0.4, 0.4), 'losses/reg': (0.25, 0.2, 0.2)}
    assert stages.terms(step_with(both, (0.75, 0.6, 0.6))) is None


def test_a_diagnosis_of_another_kind_than_the_place_is_said():
    module = Location('module', 'LayerNorm_0', 'norm', 'it computes something else')
    assert module.disagrees('randomness') and not module.disagrees('math') and not module.disagrees('')
    assert Location('update', 'the update rule', 'the update rule', '').disagrees('math')
    assert not module.unplaced('not located', Unplaced.LATER).disagrees('randomness')
    assert not module.disagrees('non-finite')
    result = checked('distortion-weight')
    slipped = dataclasses.replace(result.verdict, location=dataclasses.replace(result.verdict.location, kind='update'))
    said = render.verdict_json(dataclasses.replace(result, verdict=slipped))
    assert said['where_disagrees'] and not render.verdict_json(result)['where_disagrees']
