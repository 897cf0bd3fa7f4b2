"""The port checked from the team's own test suite: `python -m pytest` in this folder."""

import my_port
import pytest

from equivalence import check
from equivalence.testing import assert_port_matches, require_devices


@pytest.mark.parametrize('devices', [1, 2, 4, 8], ids=lambda d: f'D{d}')
def test_port_matches(devices):
    assert_port_matches(my_port.LOOP, devices=devices, steps_per_call=2, calls=2)


def test_a_slip_is_caught():
    """The warmup read from the step after it is counted: the first update is not 0, the parameters part."""
    require_devices(2)
    result = check(my_port.LOOP_WARMUP_SLIP, devices=2, steps_per_call=2, calls=2, diagnose=False)
    assert result.outcome.label == 'MISMATCH'
    assert any(leaf.group == 'params' and not leaf.ok for leaf in result.report.leaves)
