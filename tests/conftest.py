"""Simulated CPU devices are requested here, before any test module imports JAX."""

from equivalence import devices

devices.simulate_cpu_devices()

import jax  # noqa: E402
import pytest  # noqa: E402


def require_devices(n: int) -> None:
    have = len(jax.devices())
    if have < n:
        pytest.skip(f'needs {n} devices, JAX sees {have}; run with JAX_NUM_CPU_DEVICES={n} to simulate them')
