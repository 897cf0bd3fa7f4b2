"""The fresh process of a twin that needs another device count (``verdict.fresh``): the port loaded by
name afresh, its kind built, the twin run on this process's devices, its results written back.

``python -m equivalence.core.kinds.twin_process SPEC N REQUEST RESULT RECORD``: ``RECORD`` is a JSON
record of how it ended, ``{"outcome": "done"}`` or ``{"outcome": "failed", "error": TYPE, "message":
its first line}``, which the parent reads (not this process's stderr).
"""

import json
import pickle
import sys

import jax

from equivalence.core import kinds
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.rng import draws
from equivalence.core.run.inputs import Inputs
from equivalence.core.twins import twin


def child(spec: str, n: int, ask: str, answer: str) -> None:
    """The fresh process: the twin on this process's ``n`` devices, its results to ``answer``."""
    if len(jax.devices()) != n:
        raise RuntimeError(f'the fresh process sees {len(jax.devices())} devices, not {n}')
    with open(ask, 'rb') as f:
        request = pickle.load(f)
    kind, config = kinds.of(workloads.get(spec)), RunConfig(**request['config']).run  # validated, then its run
    rng = jax.numpy.asarray(request['rng'])
    inputs = Inputs(request['variables'], request['calls'], rng, request['mapping'])
    drawn = draws.FirstCall() if request['draws'] else None
    result = twin.run_twin(kind, config, inputs, n, record=drawn)
    out = {'final': result.final, 'losses': result.losses, 'params_per_call': result.params_per_call,
           'metrics': result.metrics, 'mesh': result.mesh, 'draws': drawn and drawn.draws,
           'memory': result.memory}  # fmt: skip
    with open(answer, 'wb') as f:
        pickle.dump(out, f)


def main(argv: list[str]) -> int:
    spec, n, ask, answer, said = argv
    try:
        child(spec, int(n), ask, answer)
    except Exception as e:  # noqa: BLE001 -- the parent reports it as why the twin did not run
        message = (str(e).splitlines() or [''])[0][:400]
        record(said, {'outcome': 'failed', 'error': type(e).__name__, 'message': message})
        return 1
    record(said, {'outcome': 'done'})
    return 0


def record(path: str, what: dict) -> None:
    with open(path, 'w') as f:
        json.dump(what, f)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
