"""``where:`` on the shapes of slip it placed wrong in ports nobody here wrote (issue 40), each on the
mlp example's loop port with an EMA (``where_ports.py``): the kind it names and the figures that say
so, and the correct port (the negative control) located nowhere. A wrong place is worse than none:
the NaN batch is not located at all."""

import re

import pytest
import where_ports as wp
from conftest import require_devices

from equivalence.core import harness


def located(name: str):
    require_devices(2)
    result = harness.check(wp.PORTS[name], devices=2, steps_per_call=2, calls=2, locate=True)
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
        # A weight decay added after the learning-rate scale, masked to the kernels.
        ('decay-after-lr', 'update', [r'-0\.01 x the parameter on the kernels']),
        # The pmap step's own collectives: a loss each device reports alone, gradients not averaged.
        ('loss-not-pmeaned', 'collective', ['its reported loss', 'differs from device to device']),
        ('grads-not-pmeaned', 'collective', ['its gradients', 'missing_pmean']),
        # NaN in the data: both sides go non-finite; no module is to blame.
        ('nan-data', 'unlocated', ['the batch of step 4 holds NaN']),
    ],
)
def test_where_names_the_stage_that_parts_or_nothing(name, kind, figures):
    outcome, loc = located(name)
    assert outcome == ('MATCH' if name == 'correct' else 'MISMATCH'), (name, outcome)
    assert loc is not None and loc.kind == kind, (name, loc and loc.line())
    for figure in figures:  # regular expressions: a decay fitted in float64 to float32 arithmetic
        assert re.search(figure, loc.line()), (name, figure, loc.line())
