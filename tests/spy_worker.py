"""``python -m equivalence.run``, run by the same launcher and worker mode, with two test hooks.

- Records what each process hands JAX on the batch path (the rows it read, pmap's per-process
  batch and keys, the local data given to ``jax.make_array_from_process_local_data`` for arrays
  that span processes and, apart, for arrays on this process's devices alone (the verdict's twin),
  and the rows its devices hold of the global NNX batch) into ``$SPY_DIR/process-I.json``.
- With ``SPY_FAIL_PROCESS=I``, process I raises after its second compiled call, while the others
  go on into the next call's collectives: an exception in one process mid-run.
- With ``SPY_KILL_IN_SAVE=I:N``, process I SIGKILLs itself during its N-th legacy checkpoint
  save, once Orbax has made the step's temporary directory: a worker killed mid-save.
- With ``SPY_TWIN_FAIL_PROCESS=I``, the verdict's twin raises in process I alone, after its first
  call: the others' twins go on to share their results.

Run from ``tests/`` (``python -m spy_worker --processes 2 ...``), so that the workers the launcher
starts find this module too.
"""

import json
import os
import sys

from equivalence import cli, distributed
from equivalence import run as command

MODULE = 'spy_worker'


def held_rows(x, axis: int) -> int:
    """Rows along ``axis`` of a global array held by this process's devices (replicas counted once)."""
    spans = {(s.index[axis].start or 0, s.index[axis].stop or x.shape[axis]) for s in x.addressable_shards}
    return sum(stop - start for start, stop in spans)


def install(record: dict) -> None:
    import jax

    from equivalence.core.run import inputs as made
    from equivalence.core.run import setups

    def wrap(owner, name, before):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            before(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)

    def first(tree) -> list[int]:
        return list(jax.tree.leaves(tree)[0].shape)

    def legacy_call(setup, args):
        (keys, _), batch = args
        record.setdefault('legacy_batch', first(batch))
        record.setdefault('legacy_keys', list(keys.shape))

    def nnx_call(setup, args):
        _, batch = args
        x = jax.tree.leaves(batch)[0]
        record.setdefault('nnx_global_batch', list(x.shape))
        record.setdefault('nnx_held_rows', held_rows(x, 1))

    def local_data(sharding, data, *rest, **kw):
        # Across processes: the checked runs. On this process's devices alone: the verdict's twin.
        key = 'local_data' if not sharding.is_fully_addressable else 'own_devices_data'
        record.setdefault(key, []).append(list(getattr(data, 'shape', ())))

    original_inputs = made.make_inputs

    def make_inputs(port, config, started=None):
        variables, calls, rng = original_inputs(port, config, started)
        record['read'] = first(calls[0])
        return variables, calls, rng

    made.make_inputs = make_inputs  # what the orchestration's inputs call
    wrap(setups.LegacySetup, 'call', legacy_call)
    wrap(setups.NnxSetup, 'call', nnx_call)
    wrap(setups.NnxGraphSetup, 'call', nnx_call)  # args (keys, batch): the batch is last as well
    wrap(jax, 'make_array_from_process_local_data', local_data)


def inject_fault() -> None:
    """Process ``SPY_FAIL_PROCESS`` raises after its second compiled call."""
    import jax

    progress_log = distributed.progress_log

    def failing(total: int):
        tick, calls = progress_log(total), [0]

        def fail_on_second(path: str) -> None:
            tick(path)
            calls[0] += 1
            if calls[0] == 2 and jax.process_index() == int(os.environ['SPY_FAIL_PROCESS']):
                raise ValueError(f'injected fault in process {jax.process_index()}')

        return fail_on_second

    distributed.progress_log = failing


def fail_twin(process: int) -> None:
    """Process ``process``'s twin raises once its first call is done (the progress hook runs after each call)."""
    import jax

    from equivalence.core.run import sides

    run_calls = sides.run_calls

    def failing(setup, calls, rng, mapping, progress, path, *rest, **kwargs):
        if path == 'twin' and jax.process_index() == process:

            def progress(done: str) -> None:
                raise ValueError(f'injected twin fault in process {process}')

        return run_calls(setup, calls, rng, mapping, progress, path, *rest, **kwargs)

    sides.run_calls = failing


def kill_in_save(process: int, nth: int) -> None:
    """Process ``process`` runs its ``nth`` legacy save in a thread and SIGKILLs itself as soon as
    the step's temporary directory exists: the save has begun and cannot have been committed (the
    commit waits for every process)."""
    import signal
    import threading
    import time

    import jax

    from legacy_pmap import checkpoints

    original, saves = checkpoints.save, [0]

    def save(manager, step, *args, **kwargs):
        saves[0] += 1
        if saves[0] != nth or jax.process_index() != process:
            return original(manager, step, *args, **kwargs)
        threading.Thread(target=original, args=(manager, step, *args), kwargs=kwargs, daemon=True).start()
        while not any(name.startswith(f'{step}.orbax-checkpoint-tmp') for name in os.listdir(manager.directory)):
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoints.save = save


def spied(validated) -> int:
    import jax

    record: dict = {}
    install(record)
    if 'SPY_FAIL_PROCESS' in os.environ:
        inject_fault()
    if 'SPY_TWIN_FAIL_PROCESS' in os.environ:
        fail_twin(int(os.environ['SPY_TWIN_FAIL_PROCESS']))
    if 'SPY_KILL_IN_SAVE' in os.environ:
        kill_in_save(*map(int, os.environ['SPY_KILL_IN_SAVE'].split(':')))
    code = command.work(validated)
    record['process'] = jax.process_index()
    with open(os.path.join(os.environ['SPY_DIR'], f'process-{jax.process_index()}.json'), 'w') as f:
        json.dump(record, f)
    return code


def main() -> int:
    return cli.dispatch(MODULE, command.inputs, spied)


if __name__ == '__main__':
    sys.exit(main())
