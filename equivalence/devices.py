"""Device setup for the CLIs and tests: must run before JAX starts its backend."""

import os
import sys

SIMULATED_CPU_DEVICES = 8  # what a CPU-only machine simulates unless told otherwise


def user_chose_cpu_count() -> bool:
    return 'JAX_NUM_CPU_DEVICES' in os.environ or 'xla_force_host_platform_device_count' in os.environ.get(
        'XLA_FLAGS', ''
    )


def simulate_cpu_devices(n: int = SIMULATED_CPU_DEVICES) -> None:
    """Ask for ``n`` CPU devices unless the user set a count. Harmless where a GPU
    exists: JAX's default backend is then the GPU and this only shapes the CPU backend."""
    if 'jax' in sys.modules:
        raise RuntimeError('simulate_cpu_devices must run before jax is imported')
    if not user_chose_cpu_count():
        os.environ['JAX_NUM_CPU_DEVICES'] = str(n)
