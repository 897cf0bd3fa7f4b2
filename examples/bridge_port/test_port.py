"""The port checked from the team's own test suite: `python -m pytest` in this folder."""

import my_port
import pytest

from equivalence import check
from equivalence.testing import assert_port_matches, require_devices


@pytest.mark.parametrize('devices', [1, 2, 4, 8], ids=lambda d: f'D{d}')
def test_port_matches(devices):
    assert_port_matches(my_port.LOOP, devices=devices, steps_per_call=2, calls=2)


def test_the_key_array_itself_matches():
    """``rngs=dropout_rng``: linen draws from the 'params' key it is handed, as apply's 'dropout' one."""
    require_devices(2)
    assert_port_matches(my_port.LOOP_RAW_KEY, devices=2, steps_per_call=2, calls=2)


def test_a_slip_is_caught():
    """The wrapper's own nnx.Rngs reseeded with the step's key: linen draws other masks, the losses part."""
    require_devices(2)
    result = check(my_port.LOOP_RNGS_SLIP, devices=2, steps_per_call=2, calls=2, diagnose=False)
    assert result.outcome.label == 'MISMATCH'
    assert any(leaf.name == 'losses/per_step' and not leaf.ok for leaf in result.report.leaves)
