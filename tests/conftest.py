"""Simulated CPU devices are requested here, before any test module imports JAX."""

import os
import subprocess
import sys

from equivalence import devices

devices.simulate_cpu_devices()

# XLA's persistent compilation cache is not turned on here (a segmentation fault inside its
# serialisation once, and entries some CPUs reject: shared_programs.py). Instead the tests of one
# pytest worker share the programs they compile, in memory. Set JAX_COMPILATION_CACHE_DIR yourself
# to use the persistent cache too (the commands the tests start inherit it).

import jax  # noqa: E402
import pytest  # noqa: E402
import shared_programs  # noqa: E402

shared_programs.install()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def require_devices(n: int) -> None:
    have = len(jax.devices())
    if have < n:
        pytest.skip(f'needs {n} devices, JAX sees {have}; run with JAX_NUM_CPU_DEVICES={n} to simulate them')


def run_module(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root, as a user on a fresh shell would:
    no device count inherited from this test process, so the CLI makes its own choice."""
    environ = {k: v for k, v in os.environ.items() if k not in ('JAX_NUM_CPU_DEVICES', 'XLA_FLAGS')}
    return subprocess.run(
        [sys.executable, '-m', module, *args],
        cwd=ROOT,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_pytest_in(folder, *args: str, env: dict[str, str] | None = None, timeout: int = 600):
    """``python -m pytest -q`` in ``folder``, as a team runs its own tests there: no device count
    inherited from this test process; ``env`` adds to the environment (``PYTHONPATH``, say)."""
    drop = ('JAX_NUM_CPU_DEVICES', 'XLA_FLAGS', 'PYTHONPATH')
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run(
        [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *args],
        cwd=folder,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, expected: str) -> None:
    """Bad input: exit 2, one ``error: ...`` line on stderr naming the problem, no traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: ') and expected in lines[0], proc.stderr
