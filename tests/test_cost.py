"""What a check costs, as it measures it (``core/measure/clock.py``): its stages said on stderr as they
happen, piped or not; its ``timing`` in the JSON and its one ``time:`` line; and JAX's persistent
compilation cache (``equivalence/compilation_cache.py``), which makes a second check of the same port
read its programs instead of compiling them, also for a port that stubs ``tensorflow``. Figures of
seconds are not asserted (shared machines): only what the counts and the lines say."""

import collections
import dataclasses
import functools
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, message_lines

from equivalence import compilation_cache
from equivalence.core.measure import clock

STUB_PORT = """
import sys, types
sys.modules['tensorflow'] = types.ModuleType('tensorflow')  # as ports of score_sde stub it: __spec__ None
from equivalence.core.port.workloads import WORKLOADS
PORT = WORKLOADS['mlp']
"""


def _check(tmp_path, cache, json_name: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, 'EQUIVALENCE_COMPILATION_CACHE': str(cache), 'PYTHONPATH': f'{tmp_path}{os.pathsep}{ROOT}'}
    env.pop('JAX_COMPILATION_CACHE_DIR', None)
    out = tmp_path / json_name
    argv = ['--workload', 'stub_port:PORT', '--devices', '2', '--calls', '2', '--steps-per-call', '2', '--locate',
            '--verbose', '--json', out]  # fmt: skip
    proc = subprocess.run([sys.executable, '-m', 'equivalence.run', *map(str, argv)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, json.loads(out.read_text())['timing']


def test_a_second_check_reads_its_programs_from_the_cache_and_says_its_stages_as_they_happen(tmp_path):
    """Two checks of a port that stubs tensorflow, in two processes, stderr piped: the first compiles
    and writes the cache; the second reads every program it runs from it (none compiled afresh), and no
    cache read fails. The programs with host callbacks too (``--locate``: the first step recorded module
    by module), which JAX itself never writes: the second check's recordings, read back with its own
    callbacks, say the same ``where:``. Both say each stage on stderr, and the text ends on the time line
    above the verdict."""
    (tmp_path / 'stub_port.py').write_text(STUB_PORT)
    cache = tmp_path / 'cache'
    first, t1 = _check(tmp_path, cache, 'first.json')
    second, t2 = _check(tmp_path, cache, 'second.json')
    assert t1['programs'] > t1['cached'] and any(cache.iterdir())  # the verdict reads the run's own programs again
    assert t2['programs'] == t2['cached'] > 0, t2  # every program read, none compiled
    assert any(f.name.split('-cache')[0].endswith(compilation_cache.CALLBACKS) for f in cache.iterdir())
    where = [[line for line in proc.stdout.splitlines() if line.startswith('where:')] for proc in (first, second)]
    assert where[0] == where[1] and len(where[0]) == 1 and 'module calls' in where[0][0], where
    for proc, timing in ((first, t1), (second, t2)):
        assert 'Error reading persistent compilation cache' not in proc.stderr, proc.stderr[-2000:]
        said = proc.stderr.strip().splitlines()
        names = [s['name'] for s in timing['stages'] if s['depth'] <= 1]
        assert all(any(line.lstrip().startswith(name) for line in said) for name in names), (names, said)
        assert message_lines(proc.stderr) == [], said  # every line a stage's (its record), none a message
        *_, time_line, memory_line, verdict = proc.stdout.strip().splitlines()
        assert time_line.startswith(f'time: {timing["wall_s"]:.1f} s') and verdict.startswith('MATCH')
        assert memory_line.startswith('memory: host peak '), memory_line
    top = [s['name'] for s in t1['stages'] if s['depth'] == 0]
    # a model port's two programs are the suite's: both traced and compiled on threads, then each side runs
    sides = ['legacy side', 'new side'] * 2
    # linen's initialisation compiles on a thread while the pre-flight runs
    assert [clock.short(n) for n in top] == ['initial variables', 'pre-flight', 'inputs', *sides, 'verdict'], top
    at = [s for s in t1['stages'] if s['depth'] == 0]
    assert [s['name'].endswith(('compiled on a thread', '(run)')) for s in at[3:7]] == [True] * 4, top
    assert sum(s['programs'] for s in at[3:5]) >= 2  # each program counted where it was handed over


def test_stage_lines_begin_when_slow_nest_under_their_stage_and_say_a_failure_only_once_begun():
    """``clock.Lines``: a stage said when it has run its delay, its seconds appended to the same line; a
    stage with parts said before them; a quick stage one line as it ends; a quick failure says nothing
    (the command's error line is then the only line), a slow one that it failed."""
    import time

    from equivalence.core.measure import said

    out, before = io.StringIO(), len(said.read(os.environ[said.EVENTS_ENV]))
    c = clock.Clock(clock.Lines(out, delay=0.05))
    with c.stage('verdict'):
        with c.stage('twin on 1 device(s)'):
            time.sleep(0.2)
            assert out.getvalue() == 'verdict ...\n  twin on 1 device(s) ...'  # begun, as it happens
        with c.stage('quick'):
            pass
    try:
        with c.stage('pre-flight'):
            raise ValueError
    except ValueError:
        pass
    try:
        with c.stage('slow'):
            time.sleep(0.2)
            raise ValueError
    except ValueError:
        pass
    assert out.getvalue() == textwrap.dedent("""\
        verdict ...
          twin on 1 device(s) ... 0.2 s
          quick ... 0.0 s
        verdict: done in 0.2 s
        slow ... failed after 0.2 s
    """), out.getvalue()
    records = said.read(os.environ[said.EVENTS_ENV])[before:]  # each line, as the typed record read back
    assert [s.line for s in records] == out.getvalue().splitlines()
    states = [('verdict', 'begun'), ('twin on 1 device(s)', 'done'), ('quick', 'done'), ('verdict', 'done')]
    assert [(s.stage, s.state) for s in records] == [*states, ('slow', 'failed')]


def test_work_handed_to_a_thread_counts_in_the_stage_that_handed_it_over():
    """``clock.on_thread``: a compile on the thread counts in the stages open where the work was handed over
    (even once they have ended), not in the stage open in the other thread meanwhile; the check's totals
    count it once. An error on the thread is kept, never raised: the work is only ever a head start."""
    import threading

    with clock.measuring() as c:
        started = threading.Event()
        with clock.stage('legacy side: traced, compiled on a thread') as handed:
            work = clock.on_thread(lambda: (started.wait(5), c.compiled(2.0, 'jit(_fun)'), 'compiled')[-1])
        with clock.stage('new side: compiled, run') as other:
            c.compiled(1.0, 'jit(train_calls)')
            started.set()
            assert work.result() == 'compiled' and work.error is None
        failed = clock.on_thread(lambda: 1 / 0)
        assert failed.result() is None and isinstance(failed.error, ZeroDivisionError)
    assert (handed.compile_s, handed.programs, other.compile_s, other.programs) == (2.0, 1, 1.0, 1)
    assert (c.compile_s, c.programs, dict(c.names)) == (3.0, 2, {'jit(_fun)': 1, 'jit(train_calls)': 1})


def _held(vit, name: str, batch: int) -> tuple[int, int, int]:
    """``(module calls, bytes moved to the host, programs compiled or read)`` of the first step's forward pass
    held module by module (what a MATCH with noise-dominated leaves runs), for the ViT example's rung ``name``."""
    from equivalence.core import kinds
    from equivalence.core.locate.first_step import Recorder
    from equivalence.core.port.config import RunConfig
    from equivalence.core.run import inputs as made
    from equivalence.core.run.nudge import DRAWS

    port = vit.sized(name)
    config = RunConfig(workload=port.name, devices=1, steps_per_call=1, calls=1, batch_size=batch, rng_mode='global')
    recorder = Recorder(kinds.of(port), config, made.make(port, config), DRAWS[0])
    with clock.measuring() as measured:
        _, raw = recorder.forward
    moved = sum(
        a.nbytes for side in raw.values() for r in side.values() for i, o in r.values.values() for a in [*i, *o]
    )
    timing = measured.summary()
    return len(raw['new']), moved, timing['programs'] + timing['cached']


def test_the_first_step_held_grows_as_the_model_and_not_with_the_batch():
    """issue 59: at real sizes the hold was what did not scale (a ViT-B at batch 64 on a TPU chip: 358 of its
    check's 559 s, 13 GB through the host). One encoder block at batch 16, two at batch 32: the programs it
    compiles do not grow with the depth, and the bytes it moves grow no faster than its module calls (as the
    run's own work does), the batch twice as large moving no more (each device's first 8 rows are kept: moving
    them all, the bytes grew twice as fast as the calls)."""
    import dataclasses

    from conftest import import_example

    (vit,) = import_example('vit_port', 'my_port')
    vit.LADDER['test-1'] = dataclasses.replace(vit.LADDER['6e3'], num_layers=1)
    try:
        calls_1, bytes_1, programs_1 = _held(vit, 'test-1', 16)
        calls_2, bytes_2, programs_2 = _held(vit, '6e3', 32)
    finally:
        del vit.LADDER['test-1']
    assert programs_2 == programs_1, (programs_1, programs_2)
    assert bytes_2 / bytes_1 <= 1.1 * calls_2 / calls_1, (bytes_1, bytes_2, calls_1, calls_2)


def test_a_checks_models_are_merged_from_one_trace_of_the_port_constructor():
    """A check builds its NNX model holding linen's weights five times (the run, two twins, the first step
    recorded): each was an ``nnx.eval_shape`` of the whole constructor (1.2 s each for a ViT-S). The graph is
    traced once per port; each model is merged anew from it, with Variables of its own, holding the same values."""
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx

    from equivalence.core.port import workloads
    from equivalence.core.port.config import RunConfig
    from equivalence.core.record import intercept
    from equivalence.core.rng import draws
    from equivalence.core.run import facts
    from equivalence.core.run import inputs as made

    built = []
    base = workloads.get('cnn')  # BatchNorm and Dropout: statistics and a random stream of its own

    def constructor(rngs):
        built.append(1)
        return base.nnx_model(rngs)

    port = dataclasses.replace(base, nnx_model=constructor)
    config = RunConfig(workload=port.name, devices=1, steps_per_call=1, calls=1, batch_size=8, rng_mode='global')
    inputs = made.make(port, config)
    first = facts.model_holding(port, inputs.variables, inputs.mapping)
    before = len(built)
    second = facts.model_holding(port, inputs.variables, inputs.mapping)
    # a recording's model (its own jit context, its random draws recorded) is given the constructor's keys and
    # counters as computed once: its own program compiled them again (a ViT at 2e5: 1.8 s of a 10 s hold)
    with intercept._RECORDINGS(next(intercept._SESSIONS)), draws.recording([]):
        third = facts.model_holding(port, inputs.variables, inputs.mapping)
    assert len(built) == before, 'the constructor was traced again'
    one = dict(nnx.to_flat_state(nnx.state(first)))
    for other in (second, third):
        two = dict(nnx.to_flat_state(nnx.state(other)))
        assert one.keys() == two.keys() and not any(one[p] is two[p] for p in one)
        for path in one:
            a, b = one[path].get_value(), two[path].get_value()
            assert a is not b, path  # each model its own arrays: a step may donate its state's buffers
            if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def _counting(traces: collections.Counter, side: str, fn):
    """``fn``, counting the times it is called: once per trace inside a ``jax.jit`` or ``jax.pmap``."""

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        traces[side] += 1
        return fn(*args, **kwargs)

    return counted


def _mlp_loop(traces, fast: bool):
    import jax
    from conftest import import_example
    from flax import nnx

    port, old, new = import_example('mlp_port', 'my_port', 'legacy_code', 'nnx_code')
    legacy_step = _counting(traces, 'legacy', old.train_step)  # pmap(scan(step)): traced once a trace
    if fast:  # a pytree train state holding its graphdef as a static field
        calls = jax.jit(_counting(traces, 'new', new.train_calls_fast.__wrapped__), donate_argnums=0)
        return dataclasses.replace(port.LOOP_FAST, legacy_step=legacy_step, new_call=calls)
    calls = nnx.jit(_counting(traces, 'new', new.train_calls.__wrapped__))
    new_call = lambda ts, key, batch: (ts, calls(*ts, key, batch))  # noqa: E731
    return dataclasses.replace(port.LOOP, legacy_step=legacy_step, new_call=new_call)


def _vit_steps(traces, fast: bool):
    from conftest import import_example
    from flax import nnx

    vit, new = import_example('vit_port', 'my_port', 'nnx_code')
    port = vit.LOOP  # upstream's update_fn under pmap, once a step
    step = nnx.jit(_counting(traces, 'new', new.train_step.__wrapped__))  # the team's nnx.jit, once a step
    new_step = lambda ts, batch, key: step(*ts, batch, key)  # noqa: E731
    return dataclasses.replace(port, legacy_step=_counting(traces, 'legacy', port.legacy_step), new_step=new_step)


@pytest.mark.parametrize(('form', 'fast'), [('fused', False), ('fused', True), ('steps', False)])
def test_the_run_traces_neither_step_again_after_the_pre_flight(form, fast):
    """The pre-flight traces each side's step, and the run (both sides built, compiled and run) finds those
    traces in JAX's cache and traces neither again (a ViT at 2e5 parameters traced both steps twice, 3.4 of its
    6 s of tracing): the pre-flight traces the pmap side's very program (one per port) and the team's own new
    step, from arguments of the run's shapes and placement, and the run's new train state takes the structure
    the pre-flight traced (its optax transformation, which ``new_state`` makes afresh, is a static field of
    the trace's key). The pre-flight traces the NNX constructor once (the names paired, the new train state
    built). A loop port's fused calls (``pmap(scan)``, ``new_call`` over NNX objects, and over a
    pytree holding its graphdef) and a step form run once a step (``pmap(step)``, ``new_step``)."""
    from equivalence.core import harness
    from equivalence.core.port.config import RunConfig
    from equivalence.core.run import sides

    traces: collections.Counter = collections.Counter()
    port = (_mlp_loop if form == 'fused' else _vit_steps)(traces, fast)
    port = dataclasses.replace(port, nnx_model=_counting(traces, 'constructor', port.nnx_model))
    config = RunConfig(workload=port.name, devices=2, steps_per_call=2, calls=2, batch_size=8, rng_mode='global')
    harness.validate(port, config)
    prepared = harness.prepare(port, config)
    # the pre-flight's: each step once, and the NNX constructor once (the names paired and the new train state
    # built from one abstract model)
    assert traces == {'legacy': 1, 'new': 1, 'constructor': 1}, traces
    old, new = sides.both_sides(prepared.kind, prepared.run, prepared.inputs)
    assert (traces['legacy'], traces['new']) == (1, 1), traces  # neither step again
    assert len(old.losses) == len(new.losses) == 4
