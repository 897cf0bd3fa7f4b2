"""What is installed, read without importing it: a package's version (``version``), and so how the JAX installed
is told to simulate CPU devices (``cpu_devices``): jax 0.4, where the pmap code ran (``equivalence.record``),
reads only XLA's flag, not ``JAX_NUM_CPU_DEVICES``."""

import importlib.metadata

XLA_COUNT = 'xla_force_host_platform_device_count'  # XLA's own flag for the CPU device count


def version(package: str = 'jax') -> tuple[int, ...]:
    """``package``'s installed version as numbers, read without importing it: ``(0, 4, 38)``; () where absent."""
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(p) for p in text.split('.')[:3] if p.isdigit())


def reads_num_cpu_devices() -> bool:
    """Whether the JAX installed reads ``JAX_NUM_CPU_DEVICES`` (jax 0.5 and later; 0.4 reads XLA's flag alone)."""
    return version() >= (0, 5)


def cpu_devices(n: int) -> str:
    """The environment setting that gives ``n`` simulated CPU devices on the JAX installed, as a user types it."""
    return f'JAX_NUM_CPU_DEVICES={n}' if reads_num_cpu_devices() else f'XLA_FLAGS=--{XLA_COUNT}={n}'
