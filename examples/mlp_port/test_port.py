"""The port checked from the team's own test suite: `python -m pytest` in this folder."""

import my_port
import pytest

from equivalence.testing import assert_port_matches, assert_port_matches_across_processes


@pytest.mark.parametrize('devices', [1, 2, 4, 8])
@pytest.mark.parametrize('port', [my_port.MODEL, my_port.LOOP], ids=['model', 'loop'])
def test_port_matches(port, devices):
    assert_port_matches(port, devices=devices)


def test_loop_matches_across_two_processes():
    """The layout of two hosts: two jax.distributed processes of 2 devices, pmap and the mesh spanning both."""
    assert_port_matches_across_processes('my_port:LOOP', processes=2, devices=4)
