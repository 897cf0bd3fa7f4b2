"""The pytest side of the suite: check a port from your own test suite.

In your ``conftest.py``, before anything imports JAX::

    pytest_plugins = ['equivalence.testing']

This requests simulated CPU devices (8, unless ``JAX_NUM_CPU_DEVICES`` or ``XLA_FLAGS``
chose a count), turns on JAX's persistent compilation cache (``equivalence.compilation_cache``:
``EQUIVALENCE_COMPILATION_CACHE=0`` turns it off) and silences the one warning pmap-era code always raises (donating the
batch, as score_sde did: no output can reuse it). Then, in a test::

    @pytest.mark.parametrize('devices', [1, 2, 4, 8])
    def test_port(devices):
        assert_port_matches(my_port.MODEL, devices=devices)

Across processes, the layout of a cluster (one ``jax.distributed`` process per host): the port
is named as for ``--workload``, and the helper starts the workers itself::

    def test_port_across_processes():
        assert_port_matches_across_processes('my_port:LOOP', processes=2, devices=8)
"""

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import pytest

from equivalence import compilation_cache as _compilation_cache
from equivalence import devices as _devices

_devices.simulate_cpu_devices()
_devices.quiet_xla_warnings()
_compilation_cache.use([])  # a second test session reads its programs from disk

WARNINGS = ('ignore:Some donated buffers were not usable',)  # the batch, donated as score_sde did
RELEASE_AT = 0.5  # share of the kernel's memory-map limit past which a check releases compiled programs


def pytest_configure(config) -> None:
    for line in WARNINGS:
        config.addinivalue_line('filterwarnings', line)


def require_devices(n: int) -> None:
    """Skip, saying how to get them, when JAX sees fewer than ``n`` devices."""
    import jax

    from equivalence.core.port import installed

    have = len(jax.devices())
    if have < n:
        pytest.skip(f'needs {n} devices, JAX sees {have}; run with {installed.cpu_devices(n)} to simulate them')


class PortMismatch(AssertionError):
    """``assert_port_matches`` found the sides apart (MISMATCH or NOT VERIFIED): an ``AssertionError``,
    as numpy.testing's and chex's assertions fail, so ``pytest.raises(AssertionError)`` catches it.
    ``report``: the text shown (the header, the diagnosis and ``where:``, the worst leaves, the verdict);
    ``result``: the ``RunResult``."""

    def __init__(self, report: str, result):
        super().__init__(report)
        self.report, self.result = report, result


class PortInputError(AssertionError, pytest.fail.Exception):
    """A mistake in the port or the flags (a ``ConfigError``, or an exception the port's own code raised
    while it trained): its one ``error: ...`` line. An ``AssertionError``, and pytest's own failure
    without a traceback (``pytest.fail(..., pytrace=False)``, as before), so a test shows that line only."""

    def __init__(self, line: str):
        AssertionError.__init__(self, line)
        pytest.fail.Exception.__init__(self, line, pytrace=False)

    def __str__(self) -> str:
        return self.msg


def assert_port_matches(port, devices: int, steps_per_call: int | None = None, calls: int | None = None, **flags):
    """Run both sides of ``port`` on ``devices`` devices and raise ``PortMismatch`` (an
    ``AssertionError``) with the worst leaves unless every leaf matches; returns the ``RunResult``.
    ``steps_per_call`` and ``calls`` default to 2; with ``reference=FILE``, to the reference's (as its batch,
    seed and key mode: ``equivalence.check``), and a value given that differs is refused.
    A mistake in the port is ``PortInputError`` (an ``AssertionError`` too), its one ``error:`` line.
    ``flags``: other ``RunConfig`` fields, and ``diagnose=False`` (``equivalence.check``). Once the
    process holds more than ``RELEASE_AT`` of the kernel's memory-map limit, the programs JAX keeps
    are released after the check (``equivalence.devices.release_compiled_programs``)."""
    __tracebackhide__ = True  # a failure points at the test's line, not into this helper
    from equivalence.core import harness
    from equivalence.core.compare.outcome import Outcome
    from equivalence.core.port import blame
    from equivalence.core.port.config import ConfigError
    from equivalence.core.report import render

    require_devices(devices)
    try:
        _compilation_cache.keep_programs_with_callbacks()  # JAX is imported by now
        result = harness.check(port, devices=devices, **_steps(steps_per_call, calls, flags), **flags)
    except ConfigError as e:  # a mistake in the port or the flags: its one line, not a traceback into the suite
        raise PortInputError(f'error: {e}') from None
    except Exception as e:
        line = blame.runtime_line(e)  # raised in the port's own code while it trained
        if line is None:
            raise
        raise PortInputError(f'error: {line}') from None
    finally:  # hundreds of checks in one session: their programs go before the map limit (as the corpus's)
        _devices.release_compiled_programs(RELEASE_AT)
    if result.outcome is not Outcome.MATCH:
        raise PortMismatch(render.failure(result, 'cpu'), result)
    return result


def _steps(steps_per_call: int | None, calls: int | None, flags: dict) -> dict:
    """K and C as given; left out, 2 each, or against a reference its own (``harness.check`` reads them there)."""
    defaults = {} if flags.get('reference') is not None else {'steps_per_call': 2, 'calls': 2}
    given = {'steps_per_call': steps_per_call, 'calls': calls}
    return {**defaults, **{k: v for k, v in given.items() if v is not None}}


def assert_port_matches_across_processes(
    port: str, processes: int = 2, devices: int = 8, steps_per_call: int = 2, calls: int = 2,
    flags: Sequence[str] = (), timeout_s: int = 600,
) -> dict:  # fmt: skip
    """``python -m equivalence.run --processes N --workload port``: N workers joined by
    ``jax.distributed`` on this machine, D/N simulated CPU devices each, every collective crossing
    processes. A separate command because a process joins one run, before JAX starts: this test
    process cannot. Fails with the report unless every leaf matches; returns the JSON report.
    ``port`` is ``module:NAME``; the workers find the module in its folder, and this suite where
    the test found it. ``flags``: more ``run`` flags (``['--strategy', 'fsdp']``)."""
    import jax

    from equivalence.core.port import loading

    if jax.default_backend() != 'cpu':  # a TPU chip admits one program, and its host no socket: several
        # processes on one machine are CPU devices talking over 127.0.0.1 (a cluster runs them: docs/cluster.md)
        pytest.skip(f'several processes on one machine need the CPU backend; JAX runs on {jax.default_backend()}')
    loading.load(port)  # a name that does not resolve fails here (ConfigError), before any worker starts
    module = sys.modules[port.partition(':')[0]]
    with tempfile.TemporaryDirectory(prefix='equivalence-processes-') as tmp:
        out = os.path.join(tmp, 'report.json')
        args = ['--processes', str(processes), '--devices', str(devices), '--workload', port, '--json', out,
                '--steps-per-call', str(steps_per_call), '--calls', str(calls), *flags]  # fmt: skip
        proc = subprocess.run([sys.executable, '-m', 'equivalence.run', *args], env=_worker_env(module),
                              capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
        if proc.returncode != 0:
            what = 'MISMATCH' if proc.returncode == 1 else f'exit {proc.returncode}'
            pytest.fail(f'{port} across {processes} processes: {what}\n{proc.stdout}{proc.stderr[-2000:]}')
        with open(out) as f:
            return json.load(f)


def _worker_env(module) -> dict[str, str]:
    """This environment, less the device count (the launcher sets D/N per worker; other XLA flags are
    kept), with the port's root folder and this suite's first on ``PYTHONPATH``: the workers import
    what this test imported."""
    import equivalence

    depth = module.__name__.count('.') + 1
    root = os.path.abspath(module.__file__)
    for _ in range(depth):
        root = os.path.dirname(root)
    suite = os.path.dirname(os.path.dirname(os.path.abspath(equivalence.__file__)))
    env = _devices.without_device_count(dict(os.environ))
    env['PYTHONPATH'] = os.pathsep.join(p for p in (root, suite, env.get('PYTHONPATH')) if p)
    return env
