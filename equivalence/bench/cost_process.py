"""One repeat of ``bench --cost`` in a fresh process (``bench.cost``): nothing compiled before it, the
persistent compilation cache off (the parent's environment says so), so what it measures is a first
check's cost.

``python -m equivalence.bench.cost_process MODE SPEC CONFIG`` (``CONFIG``: the ``RunConfig``'s fields as
JSON). ``MODE`` is

- ``bare``: the two runs a check compares, alone, as a team's own training runs them: the inputs (the
  data, linen's initial variables: the one initialisation both sides start from), then the pmap side
  built (its state replicated) and run for the C calls, then the new side built (its train state from the
  same weights, placed on the mesh) and run for the C calls; each program compiled once, each side's
  final state read back to the host once. No pre-flight, no copy of the parameters after every call,
  no twin, no verdict.
- ``check``: ``harness.run``, the whole check as ``python -m equivalence.run`` runs it.

Its last stdout line is one JSON object: the wall seconds of the work (after the imports and the port's
loading, which both modes share) and its CPU seconds (every thread of the process: on a machine shared with
other work, what a check does more than its bare runs, whatever the others' load), the clock's timing
(``clock.Clock.summary``), each side's per-step losses (the parent checks that every repeat computed the
same numbers) and, for a check, its outcome, diagnosis and location. A failure is one line on stderr:
exit 2 for bad input or a mistake in the port (as ``run`` says it), 3 for anything else.
"""

import json
import sys
import time

from equivalence import devices


def _train(setup, inputs) -> list[float]:
    """``setup``'s C calls in order, one in flight, then its final state read to the host once."""
    import numpy as np

    rng, losses = inputs.rng, []
    for batch_KxG in inputs.calls:
        rng, args = setup.call_args(rng, batch_KxG)
        losses.append(setup.call(args))
    setup.neutral()
    return [float(x) for x in np.concatenate(losses)]


def bare(port, config) -> dict:
    from equivalence.core import harness, kinds
    from equivalence.core.measure import clock, precision
    from equivalence.core.run import inputs as made

    harness.validate(port, config)
    kind = kinds.of(port)
    # at the check's precision (an accelerator's highest): the same numbers as the check, which a TPU's bare
    # runs at its default precision were not (vit_port on a v5e: 'the check computed the losses ...' FAIL)
    with clock.measuring() as measured, precision.computing_at(config.precision):
        with clock.stage('inputs (data, linen initial variables)'):
            inputs = made.make(port, config)
        with clock.stage('legacy side (built, compiled, run)'):
            old = _train(kind.legacy_setup(config, inputs), inputs)
        with clock.stage('new side (built, compiled, run)'):
            new = _train(kind.new_setup(config, inputs), inputs)
    return {'timing': measured.summary(), 'losses': {'legacy': old, 'new': new}}


def check(port, config) -> dict:
    from equivalence.core import harness
    from equivalence.core.report import words

    harness.validate(port, config)
    result = harness.run(port, config)
    v, location = result.verdict, result.verdict and result.verdict.location
    return {
        'timing': result.timing,
        'losses': {'legacy': [float(x) for x in result.legacy.losses], 'new': [float(x) for x in result.new.losses]},
        'outcome': result.outcome.label,
        'diagnosis_kind': str(v.kind) if v is not None else '',
        'diagnosis': words.diagnosis(v.diagnosis) if v is not None else '',
        'where': location.line() if location is not None else '',
    }


def main(argv: list[str]) -> int:
    mode, spec, fields = argv
    devices.simulate_cpu_devices()  # the parent's count, from its environment, before JAX starts
    try:
        import warnings

        from equivalence.core.port import workloads
        from equivalence.core.port.config import RunConfig

        warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
        given = json.loads(fields)
        given['mesh'] = tuple(map(tuple, given['mesh'])) if given.get('mesh') else None
        port, config = workloads.get(spec), RunConfig(**given)
        began, cpu = time.perf_counter(), time.process_time()
        out = {'bare': bare, 'check': check}[mode](port, config)
        out['wall_s'], out['cpu_s'] = time.perf_counter() - began, time.process_time() - cpu
    except Exception as e:  # noqa: BLE001 -- the parent says this line, as the repeat's failure
        from equivalence.core.port import blame
        from equivalence.core.port.config import ConfigError

        port_line = str(e) if isinstance(e, ConfigError) else blame.runtime_line(e)
        said = ' '.join((port_line or f'{type(e).__name__}: {e}').splitlines())[:600]
        print(said, file=sys.stderr)
        print(json.dumps({'mode': mode, 'failed': said, 'port': port_line is not None}))  # what the parent reads
        return 2 if port_line is not None else 3
    print(json.dumps({'mode': mode, **out}))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
