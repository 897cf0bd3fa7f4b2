"""The port checked from the team's own test suite: `python -m pytest` in this folder."""

import my_port
import pytest

from equivalence import check
from equivalence.testing import assert_port_matches


@pytest.mark.parametrize('devices', [1, 2, 4, 8])
@pytest.mark.parametrize('port', [my_port.MODEL, my_port.LOOP], ids=['model', 'loop'])
def test_port_matches(port, devices):
    assert_port_matches(port, devices=devices)


def test_a_slip_is_caught():
    """nnx.BatchNorm's default momentum (0.99) where linen said 0.9: the batch statistics differ."""
    result = check(my_port.LOOP_BN_MOMENTUM_SLIP, devices=2, steps_per_call=2, calls=2, diagnose=False)
    assert not result.report.match
    assert any(leaf.group == 'model_state' and not leaf.ok for leaf in result.report.leaves)
