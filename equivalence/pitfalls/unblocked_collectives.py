"""Pitfall 9: hundreds of collective-bearing calls queued on CPU without blocking.

JAX dispatches asynchronously: a training loop that never reads a result queues call
after call. On the CPU backend every call's all-reduce is a rendezvous of D device
threads; with many executions in flight on few cores, one thread never arrives (the
message says 7 of 8) and XLA aborts the process ("Termination timeout for all reduce ...
Exiting to ensure a consistent program state"). The safe pattern reads (blocks on) each
call's result, as the suite's harness does, so that one call is in flight.

Both versions run in a subprocess (``python -m equivalence.pitfalls.unblocked_collectives``)
with a hard time bound, so the wrong one can neither hang nor kill the caller. XLA's
CPU collective timeout is lowered from 40 s to ``TERMINATE_S`` in both, so that an abort
comes sooner; the fixed run, under the same limit, is the control that the limit is
generous for real work. The batch is placed once, as a prefetching input pipeline would.

What "behaves as documented" means here: the hazard depends on the machine (cores,
load, scheduling). On the 2-core machine this suite was built on, 200 queued calls of
this step aborted in every run (6 of 6; 8 and 4 devices), and a bare all-reduce loop
aborted at 50 and 100 calls but not at 20. It cannot be forced everywhere, so this is
the one case whose damage is not required: the case passes when the fixed run completes
and matches the pmap reference, and its symptom says honestly what the wrong run did:
aborted, hung until the bound, or "not reproduced" with the number of calls and time.
"""

import json
import os
import re
import subprocess
import sys
import time

from equivalence.pitfalls.base import CaseResult, yes

NUMBER = 9
NAME = 'unblocked_collectives'
TITLE = 'queued collective calls on CPU without blocking'
DESCRIPTION = (
    'A loop that calls the compiled sharded step hundreds of times without reading any result. '
    'Bites on CPU (tests, CI, simulated devices): the process can abort with an all-reduce rendezvous timeout. '
    'Fix: block on each call (read its loss).'
)
CALLS = 200
TERMINATE_S = 5  # XLA CPU collective terminate timeout in the subprocesses (default 40)
BOUND_S = 90  # hard wall-clock bound on each subprocess
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(devices: int) -> dict[str, str]:
    flags = (
        f'--xla_cpu_collective_call_terminate_timeout_seconds={TERMINATE_S} '
        f'--xla_cpu_collective_call_warn_stuck_timeout_seconds={max(1, TERMINATE_S // 2)}'
    )
    env = {k: v for k, v in os.environ.items() if k != 'JAX_NUM_CPU_DEVICES'}
    return {
        **env,
        'JAX_PLATFORMS': 'cpu',
        'JAX_NUM_CPU_DEVICES': str(devices),
        'XLA_FLAGS': f'{env.get("XLA_FLAGS", "")} {flags}'.strip(),
        'PYTHONPATH': os.pathsep.join(p for p in (ROOT, env.get('PYTHONPATH', '')) if p),
    }


def run_child(mode: str, devices: int, calls: int = CALLS) -> dict:
    """Run one version in a subprocess; what happened, classified."""
    cmd = [sys.executable, '-m', __name__, mode, str(calls)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=child_env(devices), capture_output=True, text=True, timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        return {'outcome': 'hung', 'seconds': BOUND_S}
    seconds = time.perf_counter() - start
    if proc.returncode == 0:
        return {'outcome': 'completed', 'seconds': seconds, **json.loads(proc.stdout.strip().splitlines()[-1])}
    fatal = rendezvous_message(proc.stderr)
    outcome = 'aborted' if fatal else 'crashed'
    last = fatal or (proc.stderr.strip().splitlines() or [''])[-1]
    return {'outcome': outcome, 'seconds': seconds, 'returncode': proc.returncode, 'message': last}


def rendezvous_message(stderr: str) -> str | None:
    """XLA's fatal rendezvous line without its log prefix and key, or None."""
    match = re.search(r'\] (?:\[id=\d+\] )?(Termination timeout for `([\w ]+?) Rendezvous.*)', stderr)
    if not match:
        return None
    return re.sub(r'RendezvousKey\{.*?\}` ', '', match.group(1).replace(f'`{match.group(2)} ', f'`{match.group(2)}` '))


def describe(wrong: dict, calls: int) -> str:
    if wrong['outcome'] == 'aborted':
        head = f'aborted (exit {wrong["returncode"]}) after {calls} queued calls, {wrong["seconds"]:.0f} s'
        return f'{head}: {wrong["message"]}'
    if wrong['outcome'] == 'hung':
        return f'hung: {calls} queued calls not finished after the {BOUND_S} s bound (killed)'
    if wrong['outcome'] == 'crashed':
        return f'crashed (exit {wrong["returncode"]}), not with the rendezvous timeout: {wrong["message"]}'
    return f'not reproduced on this machine: {calls} queued calls completed in {wrong["seconds"]:.1f} s'


def run(devices: int) -> CaseResult:
    wrong, fixed = run_child('queue', devices), run_child('block', devices)
    fixed_ok = fixed['outcome'] == 'completed' and fixed['match']
    fix = (
        f'{CALLS} calls, each blocked on: completed in {fixed["seconds"]:.1f} s, params {fixed["max_abs_params"]:.1e} '
        f'from the pmap path, within tolerance: {yes(fixed["match"])}'
        if fixed['outcome'] == 'completed'
        else f'did not complete: {describe(fixed, CALLS)}'
    )
    return CaseResult(
        symptom=describe(wrong, CALLS),
        threshold=f'abort with the rendezvous timeout, or no result within {BOUND_S} s (a hazard: not required)',
        damage_shown=wrong['outcome'] in ('aborted', 'hung'),
        fix=fix,
        fix_matches=fixed_ok,
        details={
            'calls': CALLS,
            'terminate_timeout_s': TERMINATE_S,
            'bound_s': BOUND_S,
            'wrong': wrong,
            'fixed': fixed,
        },
        damage_required=False,
    )


# ---- the subprocess: ``python -m equivalence.pitfalls.unblocked_collectives {queue,block} CALLS`` ----


def child(mode: str, calls: int) -> dict:
    import warnings

    import jax
    import numpy as np
    from flax import nnx

    from equivalence.core import harness
    from equivalence.core.compare import compare
    from equivalence.core.compare.outcome import Outcome
    from equivalence.core.port import workloads
    from equivalence.core.port.config import RunConfig
    from equivalence.core.state import convert
    from legacy_pmap import train as legacy
    from nnx_sharded import sharding
    from nnx_sharded import train as sharded

    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')
    wl = workloads.get('mlp')
    config = RunConfig(workload='mlp', devices=len(jax.devices()), steps_per_call=1, calls=1, batch_size=64)
    prepared = harness.prepare(wl, config)  # the harness's own: its kind, pre-flight, inputs
    fed, kind = prepared.inputs, prepared.kind
    batches, rng = fed.calls, fed.rng
    setup = kind.new_setup(config, fed)
    _, keys = sharded.next_call_keys(rng, config.devices, config.rng_mode)
    carry = (sharding.place_keys(keys, setup.mesh, config.rng_mode), setup.state)
    batch = sharding.place_batch(batches[0], setup.mesh)  # placed once, as a prefetching pipeline would
    start = time.perf_counter()
    for _ in range(calls):
        carry, loss_K = setup.fused(carry, batch)
        if mode == 'block':
            np.asarray(loss_K)  # the fix: read the result, one call in flight
    out = {'calls': calls, 'loop_seconds': time.perf_counter() - start, 'final_loss': float(np.asarray(loss_K)[-1])}
    if mode == 'block':
        model = nnx.merge(setup.graphdef, carry[1]).model
        params = convert.flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        reference = pmap_params(legacy, kind.legacy_setup(config, fed), batches[0], rng, calls)
        report = compare.compare({'params': reference}, {'params': params})
        out |= {'match': report.outcome is Outcome.MATCH, 'max_abs_params': report.max_abs('params')}
    return out


def pmap_params(legacy, setup, batch_KxG: dict, rng, calls: int) -> dict:
    """The same calls on the pmap path, each blocked on: the reference parameters."""
    import numpy as np

    from equivalence.core.state import convert

    for _ in range(calls):
        _, args = setup.call_args(rng, batch_KxG)
        (_, setup.pstate), loss_DxK = setup.p_train_step(*args)
        np.asarray(loss_DxK)
    return convert.flatten(legacy.unreplicate(setup.pstate.params))


if __name__ == '__main__':
    print(json.dumps(child(sys.argv[1], int(sys.argv[2]))))
