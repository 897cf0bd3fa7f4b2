"""A difference below one step's floor that grows every call as a slip in the update does (issue 61): the
reading on its own numbers (``systematic.read``: a weight decay, a learning rate, rounding, the twins' own
structure), a real port's masked weight decay that the floors passed as a MATCH, and a MATCH's sensitivity
checked against differences planted above and below it."""

import decay_ports
import numpy as np
import pytest
from conftest import require_devices

from equivalence.core import harness
from equivalence.core.port.workloads import WORKLOADS
from equivalence.core.trend import systematic

RNG = np.random.default_rng(0)
SPACING = float(np.spacing(np.float32(1.0)))


def calls(start: np.ndarray, moves: list[np.ndarray]) -> list[dict]:
    """The parameters after each call, from ``start`` and each call's move."""
    out, p = [], start
    for move in moves:
        p = (p + move).astype(np.float32)
        out.append({'w': p})
    return out


def reading(extra, twin_extra=None, k: int = 2, n: int = 64, c: int = 3):
    """One leaf ``w`` of ``n`` values near 1 trained for ``c`` calls; the new side's moves differ by
    ``extra(p, update)`` each call, and its twin's (the new side's own program) by rounding, and by
    ``twin_extra`` of its own where given."""
    start = (1 + 0.1 * RNG.normal(size=n)).astype(np.float32)
    updates = [1e-3 * RNG.normal(size=n) for _ in range(c)]
    legacy = calls(start, updates)
    rounding = lambda: SPACING * RNG.choice([-1.0, 0.0, 1.0], size=n)  # noqa: E731
    befores = [start, *(x['w'] for x in legacy[:-1])]
    moves = [u + extra(b, u) for b, u in zip(befores, updates, strict=True)]
    own = twin_extra or (lambda p, u: 0)
    new = calls(start, [m + rounding() for m in moves])
    twin = calls(start, [m + own(b, u) + rounding() for b, u, m in zip(befores, updates, moves, strict=True)])
    return systematic.read(legacy, new, {'w': start}, [(twin, {'w': start})], frozenset(), k)


def test_the_reading_finds_a_decay_and_a_learning_rate_and_not_rounding():
    decay = reading(lambda p, u: -2 * 3e-6 * p)  # a decoupled weight decay 3e-6 a step, over k = 2 steps a call
    assert [(t.leaf, t.by) for t in decay.decisive] == [('w', 'parameter')]
    assert decay.decisive[0].factor == pytest.approx(-3e-6, rel=0.05)
    lr = reading(lambda p, u: 0.01 * u)  # each call steps 1.01 x as far
    assert [(t.leaf, t.by) for t in lr.decisive] == [('w', 'update')] and lr.decisive[0].factor == pytest.approx(
        0.01, rel=0.05
    )
    # the controls: rounding alone; and a structure the run's own twin shows as much is the port's, not a slip
    assert reading(lambda p, u: 0) == systematic.Reading(steps=6)
    shared = lambda p, u: -2 * 3e-6 * p  # noqa: E731
    assert not reading(shared, twin_extra=shared).decisive
    # a decay that changes sign from call to call is no weight decay
    flips = iter([1, -1, 1])
    assert not reading(lambda p, u: next(flips) * 2 * 3e-6 * p).decisive


def test_a_weight_decay_masked_to_the_kernels_is_never_a_match():
    """The new side decays only its >= 2-D leaves where the pmap side decays all (issue 61): the floors alone
    passed it (MATCH, exit 0, at D = 2 and 4 on real code). Now the LayerNorm scale's difference, growing every
    call with the parameter, makes it NOT VERIFIED naming the steps that decide, or a MISMATCH at the update
    rule; the control, the same port decaying every leaf, is a MATCH."""
    require_devices(4)
    for devices in (1, 2, 4):
        result = harness.check(decay_ports.MASKED, devices=devices, steps_per_call=2, calls=2, diagnose=False)
        assert result.outcome.label != 'MATCH', (devices, result.verdict.lines())
        v = result.verdict
        if result.outcome.label == 'NOT VERIFIED':
            assert v.unverified.trends[0].by == 'parameter' and v.unverified.decide > 4, v.lines()
        else:
            assert v.location.kind == 'update' and v.location.reading['by'] == 'parameter', v.location.line()
    correct = harness.check(decay_ports.CORRECT, devices=2, steps_per_call=2, calls=2)
    assert correct.outcome.label == 'MATCH', correct.verdict.lines()
    decided = harness.check(decay_ports.MASKED, devices=2, steps_per_call=2, calls=8)
    assert decided.outcome.label == 'MISMATCH', decided.verdict.lines()
    loc = decided.verdict.location
    assert (loc.kind, loc.reading['by'], loc.reading['one_d_only']) == ('update', 'parameter', True), loc.line()
    assert 'rounding' not in loc.line()


def test_a_match_says_what_it_could_have_missed_and_a_difference_above_it_is_caught():
    """mlp's MATCH states the smallest relative change of the learning rate its floors catch; a learning rate
    twice that far off (``perturb``) is caught, and one a hundred times smaller is a MATCH that says it is
    below what it could see."""
    require_devices(2)
    flags = dict(devices=2, steps_per_call=2, calls=2)
    base = harness.check(WORKLOADS['mlp'], **flags)
    s = base.verdict.sensitivity
    assert base.outcome.label == 'MATCH' and s is not None and s.learning_rate > 0 and s.steps == 4
    assert harness.check(WORKLOADS['mlp'], perturb=2 * s.learning_rate, **flags).outcome.label != 'MATCH'
    below = harness.check(WORKLOADS['mlp'], perturb=s.learning_rate / 100, **flags)
    assert below.outcome.label == 'MATCH' and below.verdict.sensitivity.learning_rate > s.learning_rate / 100
