"""The port checked from the team's own test suite: `python -m pytest` in this folder."""

import jax
import my_port
import pytest

from equivalence import check
from equivalence.testing import assert_port_matches, require_devices


@pytest.mark.parametrize('devices', [1, 2, 4, 8], ids=lambda d: f'D{d}')
def test_port_matches(devices):
    result = assert_port_matches(my_port.PORT, devices=devices)
    if len(jax.devices()) > 1:  # a twin on another device count measured this port's own noise floor
        assert result.report.floor is not None, result.verdict.twin


def test_a_slip_is_caught():
    """Adam's b2 at optax's default on the NNX side: its second moments, then its steps, differ."""
    require_devices(2)
    result = check(my_port.PORT_B2_SLIP, devices=2, steps_per_call=2, calls=2, diagnose=False)
    assert not result.report.match
    assert any(leaf.name.startswith('opt_state/0/nu/') and not leaf.ok for leaf in result.report.leaves)
