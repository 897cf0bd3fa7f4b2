"""A twin in a fresh process that sees another device count: for code pinned to its own mesh.

Real linen + ``jax.jit`` code builds its mesh from ``jax.devices()`` when its module is imported
and names it in the step's ``in_shardings``/``out_shardings``. Such a step runs on every device
its process sees and on nothing else, so a twin on another device count in the same process
raises (a jit sharding error), and at D = 1 a process that sees one device has no second mesh.
This module runs the twin (``twin.run_twin``) in a child process that sees ``n`` devices: the
port's module is imported afresh there, so its mesh is built from those ``n`` devices.

The child is ``python -m equivalence.core.kinds.twin_process SPEC N REQUEST RESULT RECORD``. It is given the
checked run's config (its keys are the run's: ``[D, 2]`` in per-device mode), the linen
variables, every call's whole batch and the key chain, in ``REQUEST`` (a pickle this process
wrote); it writes the twin's final state, losses, parameters after each call, metrics and, for a
loop port, the random numbers its first call draws (``draws``) to ``RESULT``, and how it ended to
``RECORD`` (JSON: a failure's exception type and first line); a child that ended before it could
write one (a signal, a crash at import) is told by its exit status and the runtime's last stderr
line. Only where a fresh process can see another count: the CPU backend
(``JAX_NUM_CPU_DEVICES``), one process (a multi-process run's twins stay in each process), and a
port the child can import by name (``module:NAME``, or a built-in workload).
"""

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Any

CHILD = 'equivalence.core.kinds.twin_process'  # the fresh process's module (it builds the port's kind)
TIMEOUT_S = 900  # a twin is one more run of the new side: minutes at most for what the suite runs


def why_not(config: Any, resumed: bool) -> str:
    """'' when a twin can run in a fresh process; else why not."""
    import jax

    if resumed:
        return 'after --resume-at the twin restores the checkpoint in this process'
    if jax.process_count() > 1:
        return 'several processes: each runs its twin on its own devices'
    if jax.default_backend() != 'cpu':
        return f'a fresh process sees another device count on the CPU backend only, not {jax.default_backend()}'
    return ''


def locate(port: Any, config: Any) -> str:
    """What a fresh process loads the port by: a built-in's name or ``module:NAME``; '' when none names it."""
    from equivalence.core.port import loading, workloads

    if config.workload in workloads.WORKLOADS and workloads.WORKLOADS[config.workload] == port:
        return config.workload
    if loading.loaded_as(port):  # loaded by name, a factory's too: the fresh process loads it the same way
        return loading.loaded_as(port)
    found = [
        (name, attr)
        for name, module in list(sys.modules.items())
        if name != '__main__' and module is not None
        for attr, value in list(vars(module).items())
        if value is port
    ]
    own = {getattr(f, '__module__', None) for f in vars(port).values() if callable(f)}  # where its code lives
    found.sort(key=lambda pair: pair[0] not in own)
    return f'{found[0][0]}:{found[0][1]}' if found else ''


def env(n: int) -> dict[str, str]:
    """CPU with ``n`` simulated devices, and this process's import path (the port's folder on it)."""
    environ = dict(os.environ)
    flags = [f for f in environ.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
    path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    environ.update(JAX_PLATFORMS='cpu', JAX_NUM_CPU_DEVICES=str(n), XLA_FLAGS=' '.join(flags), PYTHONPATH=path)
    return environ


def run_twin(kind: Any, config: Any, inputs: Any, n: int, draws: bool):
    """``(the twin's PathResult, its first call's draws or None)`` from a fresh process on ``n`` devices;
    raises ``RuntimeError`` with one line saying why when it cannot run or failed."""
    import jax

    from equivalence.core.run import sides

    spec = locate(kind.port, config)
    if not spec:
        raise RuntimeError('the port is not importable by name (module:NAME), so no fresh process can load it')
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    rng = inputs.rng
    request = {'config': fields, 'variables': jax.device_get(inputs.variables), 'mapping': inputs.mapping,
               'calls': jax.device_get(inputs.whole_calls), 'draws': draws,
               'rng': jax.device_get(jax.random.key_data(rng) if _typed(rng) else rng)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix='equivalence-twin-') as folder:
        ask, answer, said = (os.path.join(folder, name) for name in ('request.pkl', 'result.pkl', 'ended.json'))
        with open(ask, 'wb') as f:
            pickle.dump(request, f)
        command = [sys.executable, '-m', CHILD, spec, str(n), ask, answer, said]
        proc = subprocess.run(command, env=env(n), capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f'in a fresh process on {n} device(s): {failure(said, proc)}')
        with open(answer, 'rb') as f:
            out = pickle.load(f)
    result = sides.PathResult(out['final'], out['losses'], out['params_per_call'], None, mesh=out['mesh'])
    result.metrics, result.memory = out['metrics'], out['memory']
    return result, out['draws']


def failure(said: str, proc: subprocess.CompletedProcess) -> str:
    """Why the child failed: its record (``TYPE: first line``); without one (or when it ended after its
    record said done), the last line it printed."""
    try:
        with open(said) as f:
            ended = json.load(f)
    except (OSError, ValueError):
        ended = {}
    if ended.get('outcome') == 'failed':
        return f'{ended["error"]}: {ended["message"]}'
    lines = proc.stderr.strip().splitlines() or [f'exit {proc.returncode}']
    return lines[-1]


def _typed(rng: Any) -> bool:
    import jax

    return jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
