"""The pytest side of the suite: check a port from your own test suite.

In your ``conftest.py``, before anything imports JAX::

    pytest_plugins = ['equivalence.testing']

This requests simulated CPU devices (8, unless ``JAX_NUM_CPU_DEVICES`` or ``XLA_FLAGS``
chose a count) and silences the one warning pmap-era code always raises (donating the
batch, as score_sde did: no output can reuse it). Then, in a test::

    @pytest.mark.parametrize('devices', [1, 2, 4, 8])
    def test_port(devices):
        assert_port_matches(my_port.MODEL, devices=devices)
"""

import pytest

from equivalence import devices as _devices

_devices.simulate_cpu_devices()

WARNINGS = ('ignore:Some donated buffers were not usable',)  # the batch, donated as score_sde did


def pytest_configure(config) -> None:
    for line in WARNINGS:
        config.addinivalue_line('filterwarnings', line)


def require_devices(n: int) -> None:
    """Skip, saying how to get them, when JAX sees fewer than ``n`` devices."""
    import jax

    have = len(jax.devices())
    if have < n:
        pytest.skip(f'needs {n} devices, JAX sees {have}; run with JAX_NUM_CPU_DEVICES={n} to simulate them')


def assert_port_matches(port, devices: int, steps_per_call: int = 2, calls: int = 2, **flags):
    """Run both sides of ``port`` on ``devices`` devices and fail with the worst leaves unless
    every leaf matches; returns the ``RunResult``. ``flags``: other ``RunConfig`` fields."""
    from equivalence.core import blame, harness, report
    from equivalence.core.config import ConfigError

    require_devices(devices)
    try:
        result = harness.check(port, devices=devices, steps_per_call=steps_per_call, calls=calls, **flags)
    except ConfigError as e:  # a mistake in the port or the flags: its one line, not a traceback into the suite
        pytest.fail(f'error: {e}', pytrace=False)
    except Exception as e:
        line = blame.runtime_line(e)  # raised in the port's own code while it trained
        if line is None:
            raise
        pytest.fail(f'error: {line}', pytrace=False)
    if not result.report.match:
        pytest.fail('\n'.join([report.header(result, 'cpu'), *report.leaf_table(result), report.verdict(result)]))
    return result
