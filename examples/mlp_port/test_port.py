"""The port checked from the team's own test suite: `python -m pytest` in this folder."""

import my_port
import pytest

from equivalence.testing import assert_port_matches


@pytest.mark.parametrize('devices', [1, 2, 4, 8])
@pytest.mark.parametrize('port', [my_port.MODEL, my_port.LOOP], ids=['model', 'loop'])
def test_port_matches(port, devices):
    assert_port_matches(port, devices=devices)
