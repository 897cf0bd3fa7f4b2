"""Several processes (``jax.distributed``): the same numbers as one process, bounded failure.

Each multi-process run pays JAX's start-up in every process, so the runs are tiny and
shared between assertions. The one-process references run in this pytest process
(8 simulated devices, ``conftest``).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, assert_one_line_error, at_level_0, message_lines, require_devices, run_module

from equivalence import devices
from equivalence.checkpoint import migrate
from equivalence.core import harness
from equivalence.core.compare import compare
from equivalence.core.port import workloads
from equivalence.core.report import render
from equivalence.distributed import launch
from legacy_pmap import checkpoints as legacy_checkpoints

TINY = ['--steps-per-call', '2', '--calls', '2']
TOL = compare.FLOAT32_REDUCTION_ORDER
BOUND_S = 60  # a dead worker ends the run within this, every time (the bound)
# The tests of a failure (a worker killed, raising, unreachable) and of a checkpoint across processes compile
# their workers at XLA's level 0: how the run ends, or what is saved and restored, is their subject, not the
# figures (conftest.at_level_0)
LEVEL_0 = at_level_0()


def one_process(workload: str, devices: int, **flags) -> dict:
    """The JSON report of the same run in this single process."""
    require_devices(devices)
    wl = workloads.get(workload)
    result = harness.check(wl, devices=devices, steps_per_call=2, calls=2, **flags)
    return render.to_json(result, render.versions())


def clean_env(**extra: str) -> dict[str, str]:
    """A fresh shell's environment: no device count inherited from this test process."""
    return {**devices.without_device_count(dict(os.environ)), **extra}


def start(module: str, *args: str, cwd: str = ROOT, env: dict | None = None) -> subprocess.Popen:
    """``python -m module args`` in the background, its output piped."""
    pipe = subprocess.PIPE
    return subprocess.Popen(
        [sys.executable, '-m', module, *args], cwd=cwd, env=env or clean_env(), stdout=pipe, stderr=pipe, text=True
    )


def finish(proc: subprocess.Popen, out) -> tuple[str, dict]:
    """Wait for a run that must match; its stdout and JSON report."""
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout + stderr
    return stdout, json.loads(out.read_text())


def twin_ran(report: dict, processes: int = 2) -> bool:
    """The run measured its floor with a twin in every process, and held the losses to it."""
    floors = {leaf['name']: leaf['floor'] for leaf in report['leaves']}
    measured = None not in (floors.get('first_step/loss'), floors.get('losses/per_step'))
    return report['verdict']['twin'] == f'on 1 device(s) in each of {processes} processes' and measured


def assert_same_run(multi: dict, single: dict) -> None:
    """Same verdict, same leaves (the first step's loss too: both measured a twin), every leaf held
    to its measured floor, and each path's losses equal to the suite's tolerance."""
    assert multi['match'] is single['match'] is True
    assert multi['devices'] == single['devices'] and multi['steps'] == single['steps']
    assert [leaf['name'] for leaf in multi['leaves']] == [leaf['name'] for leaf in single['leaves']]
    assert 'first_step/loss' in [leaf['name'] for leaf in multi['leaves']] and twin_ran(multi)
    assert all(leaf['ok'] for leaf in multi['leaves'])
    for path in ('legacy', 'new'):
        a, b = np.array(single['losses'][path]), np.array(multi['losses'][path])
        np.testing.assert_allclose(b, a, rtol=TOL.rtol, atol=TOL.atol, err_msg=f'{path} losses, 2 processes vs 1')
    for group, value in multi['max_abs_diff'].items():
        assert value <= TOL.atol, (group, value)


def test_two_processes_of_4_devices_match_one_process_of_8_and_each_feeds_only_its_rows(tmp_path):
    """The launcher's default split (8 devices, 4 a process) on score, whose noise, EMA and warmup
    give the processes the most to agree on; and a recorded shape: no process hands the checked runs,
    or holds, the global batch. The verdict's twin, on each process's first device alone, is given
    all of it."""
    out = tmp_path / 'report.json'
    proc = spy(tmp_path, '--processes', '2', '--workload', 'score', *TINY, '--json', str(out))
    single = one_process('score', 8)  # while the workers run
    stdout, multi = finish(proc, out)
    assert multi['workload'] == 'score' and multi['new_side'] == 'NNX' and multi['devices'] == 8
    assert stdout.count('MATCH') == 1 and '[Gloo]' not in stdout  # one report, process 0's
    assert_same_run(multi, single)
    for i in range(2):  # score's global batch 128 on 8 devices: 16 rows per device, 64 per process
        seen = json.loads((tmp_path / f'process-{i}.json').read_text())
        assert seen['read'][:2] == [2, 64]  # [K, rows of this process, ...]: what it kept
        assert seen['legacy_batch'][:3] == [4, 2, 16] and seen['legacy_keys'][0] == 4  # [its 4 devices, K, rows]
        assert seen['nnx_global_batch'][:2] == [2, 128] and seen['nnx_held_rows'] == 64
        shapes = [shape[:2] for shape in seen['local_data']]
        assert [2, 64] in shapes and [2, 128] not in shapes
        assert [2, 128] in [shape[:2] for shape in seen['own_devices_data']]  # the twin's whole batch, on its device


def test_across_processes_the_measured_floor_fails_a_slip_that_the_fixed_screen_passes(tmp_path):
    """Negative control for the twin across processes: NNX's learning rate 1.00001 times
    (``--perturb 1e-5``), which the fixed tolerance passes, is a MISMATCH against the floor of a
    twin run in each process; both processes reach it (the launcher's exit is theirs, agreed)."""
    out = tmp_path / 'report.json'
    slip = ['--perturb', '1e-5', *TINY, '--json', str(out)]
    proc = start('equivalence.run', '--processes', '2', '--devices', '4', *slip)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1 and stdout.count('MISMATCH') == 1, stdout + stderr
    report = json.loads(out.read_text())
    assert report['verdict']['done'][0] == 'fixed screen passed' and twin_ran(report)
    assert {'first-step gradients not probed: several processes', 'legacy twin not run: several processes'} <= set(
        report['verdict']['done']
    )
    assert [leaf['name'] for leaf in report['leaves'] if not leaf['ok']], report['leaves']


def spy(tmp_path, *args: str, **env: str) -> subprocess.Popen:
    """``tests/spy_worker.py`` (the run command with recording hooks) under the same launcher."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))  # this checkout's suite
    env = clean_env(SPY_DIR=str(tmp_path), PYTHONPATH=path, **env)
    return start('spy_worker', *args, cwd=os.path.join(ROOT, 'tests'), env=env)


def test_tp_in_graph_form_across_processes_feeds_the_batch_whole_to_both(tmp_path):
    """``tp`` spans both processes with its ``model`` axis, and the batch is copied over it: each
    process hands JAX all 64 rows for NNX (pmap still gets its own 32). Fed its pmap rows instead,
    as before the rows followed the sharding, this run was a MISMATCH (losses 6.3e-1 apart)."""
    out = tmp_path / 'report.json'
    flags = ['--strategy', 'tp', '--nnx-form', 'graph']
    proc = spy(tmp_path, '--processes', '2', '--devices', '4', *flags, *TINY, '--json', str(out))
    single = one_process('mlp', 4, strategy='tp', nnx_form='graph')
    assert_same_run(finish(proc, out)[1], single)
    for i in range(2):
        seen = json.loads((tmp_path / f'process-{i}.json').read_text())
        assert seen['read'] == [2, 64, 20] and seen['legacy_batch'] == [2, 2, 16, 20]
        assert seen['nnx_global_batch'] == [2, 64, 20] and seen['nnx_held_rows'] == 64


def test_resume_from_a_checkpoint_saved_across_processes_onto_an_fsdp_mesh_across_processes(tmp_path):
    """Both processes take part in every legacy save (Orbax's multi-process save: a file set per
    process, one commit); migrated, the checkpoint is read back by each process onto an FSDP mesh
    that splits the state over both, and NNX resumed at step 2 ends where legacy, uninterrupted,
    ends (the run's own verdict)."""
    out, root = tmp_path / 'report.json', tmp_path / 'checkpoints'
    args = ['--resume-at', '2', '--strategy', 'fsdp', '--checkpoint-dir', str(root), '--json', str(out)]
    # at XLA's level 0 (conftest.at_level_0): the save, the restore and the layout are the subject, not noise
    proc = start('equivalence.run', '--processes', '2', '--devices', '4', *TINY, *args, env=clean_env(**LEVEL_0))
    stdout, report = finish(proc, out)
    assert report['match'] is True and 'NNX restored it onto 4 device(s)' in stdout, stdout
    assert twin_ran(report)  # every process's twin restored the same checkpoint onto its own device
    assert sorted(os.listdir(root / 'legacy')) == ['2', '4'] and os.listdir(root / 'nnx') == ['2']
    assert {'ocdbt.process_0', 'ocdbt.process_1'} <= set(os.listdir(root / 'legacy' / '2' / 'state'))


def test_a_twin_that_raises_in_one_process_is_the_same_verdict_in_every_process(tmp_path):
    """Process 1's twin raises after its first call, process 0's does not. Had process 1 gone on to
    judge without it, process 0 would wait forever for it to share its twin (``from_process_0``):
    instead every process learns of the error, every process judges without the twin (NOT VERIFIED: no
    floor measured), and they end alike, saying which process raised what."""
    out = tmp_path / 'report.json'
    proc = spy(
        tmp_path, '--processes', '2', '--devices', '4', *TINY, '--json', str(out), **LEVEL_0, SPY_TWIN_FAIL_PROCESS='1'
    )
    stdout, stderr = proc.communicate(timeout=300)
    # judged without the twin in every process: NOT VERIFIED (no floor measured), exit 5, said once
    assert proc.returncode == 5 and stdout.count('NOT VERIFIED:') == 1, stdout + stderr
    done = json.loads(out.read_text())['verdict']['done']
    fault = 'process 1 of 2 raised ValueError: injected twin fault in process 1'
    assert done[0] == 'fixed screen passed' and any(line.startswith('twin not run') and fault in line for line in done)
    assert {json.loads((tmp_path / f'process-{i}.json').read_text())['process'] for i in range(2)} == {0, 1}


def children_of(logs) -> list[int]:
    with open(os.path.join(logs, 'workers.txt')) as f:
        return [int(line.split()[1]) for line in f]


def alive(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().split(')')[-1].split()[0] != 'Z'
    except FileNotFoundError:
        return False


def wait_for(path, text: str, timeout: float = 120) -> None:
    """Until ``text`` appears in the file at ``path`` (a worker's log): the run is under way."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.path.exists(path) and text in open(path, errors='replace').read():
            return
        time.sleep(0.1)
    raise AssertionError(f'{text!r} never appeared in {path}')


def assert_ended_with_one_line(proc: subprocess.Popen, t0: float, pids: list[int], expected: list[str]) -> str:
    _, stderr = proc.communicate(timeout=BOUND_S)
    elapsed = time.monotonic() - t0
    assert proc.returncode == launch.EXIT_WORKER_DIED, stderr
    assert elapsed < BOUND_S, elapsed
    lines = message_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith('error: ') and all(e in lines[0] for e in expected), stderr
    assert not [pid for pid in pids if alive(pid)]
    return lines[0]


def test_a_worker_killed_mid_run_ends_every_process_with_one_line_and_leaves_the_previous_checkpoint(tmp_path):
    """Process 1 is SIGKILLed mid-run, inside its second legacy save (after its second compiled call), once
    Orbax made the step's temporary directory. The launcher ends every process within the bound, saying so
    in one line that names the worker, its pid and the signal; the step is never committed (the commit
    waits for every process), step 2 stays the newest complete one, and migrate, from this one process,
    converts step 2."""
    root, logs = tmp_path / 'checkpoints', tmp_path / 'logs'
    every = ['--checkpoint-dir', str(root), '--checkpoint-every', '1', '--worker-logs', str(logs)]
    proc = spy(tmp_path, '--processes', '2', '--devices', '4', '--steps-per-call', '2', '--calls', '3', *every,
               **LEVEL_0, SPY_KILL_IN_SAVE='1:2')  # fmt: skip
    wait_for(logs / 'workers.txt', '\n1 ')  # both workers started
    pids = children_of(logs)
    end = time.monotonic() + 240
    while alive(pids[1]) and time.monotonic() < end:  # until worker 1 has killed itself
        time.sleep(0.05)
    t0 = time.monotonic()
    assert_ended_with_one_line(proc, t0, pids, ['worker 1 of 2', f'pid {pids[1]}', 'killed by SIGKILL'])
    left = sorted(os.listdir(root / 'legacy'))
    assert left[0] == '2' and left[1].startswith('4.orbax-checkpoint-tmp') and len(left) == 2, left
    assert legacy_checkpoints.open_step(str(root / 'legacy'))[1] == 2
    migration = migrate.migrate(str(root / 'legacy'), str(tmp_path / 'nnx'), workloads.get('mlp'))
    assert migration.step == 2 and migration.written


def test_an_exception_in_one_worker_ends_every_process_with_one_line(tmp_path):
    proc = spy(tmp_path, '--processes', '2', '--devices', '4', '--worker-logs', str(tmp_path), '--steps-per-call', '2',
               '--calls', '400', **LEVEL_0, SPY_FAIL_PROCESS='1')  # fmt: skip
    wait_for(tmp_path / 'worker-1.log', 'compiled call 2/')
    t0 = time.monotonic()
    pids = children_of(tmp_path)
    line = assert_ended_with_one_line(proc, t0, pids, ['worker 1 of 2', 'internal error'])
    assert 'ValueError: injected fault in process 1' in line


def test_on_a_cluster_the_survivors_of_a_dead_worker_end_within_the_heartbeat_timeout(tmp_path):
    """No launcher: the survivor ends within JAX's heartbeat (here 5 s, ``--heartbeat-timeout``, so that the
    test waits less; at the default 10 s, measured ~8 s after a SIGKILL),
    and says a peer is gone. Three things can notice first, and which does depends on where the
    survivor was when its peer died, not on the machine: JAX's heartbeat (an abort naming the
    silent peer), the survivor's own collective failing on the closed connection (then exit 4
    and one line, ``a peer process left the run``, never the internal error of exit 3), or gloo
    itself aborting in C++ on the half-sent message (``gloo::EnforceNotMet ... Received data size
    doesn't match``, SIGABRT; seen once in CI: no Python runs after it, so no line of ours)."""
    port = launch.free_port()
    env = clean_env(JAX_NUM_CPU_DEVICES='2', **LEVEL_0)
    procs, logs = [], []
    for i in range(2):
        flags = ['--coordinator', f'127.0.0.1:{port}', '--num-processes', '2', '--process-id', str(i)]
        flags += ['--heartbeat-timeout', '5']
        logs.append(open(tmp_path / f'worker-{i}.log', 'w'))
        command = [sys.executable, '-m', 'equivalence.run', *flags, '--steps-per-call', '2', '--calls', '400']
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=logs[-1]))
    try:
        wait_for(tmp_path / 'worker-1.log', 'compiled call 2/')
        procs[1].kill()
        t0 = time.monotonic()
        code = procs[0].wait(timeout=BOUND_S)
        assert code != 0 and time.monotonic() - t0 < 30, code  # heartbeat 5 s, with margin for a loaded machine
        log = (tmp_path / 'worker-0.log').read_text()
        errors = [line for line in log.splitlines() if line.startswith('error: ')]
        gloo_abort = code == -signal.SIGABRT and 'gloo::EnforceNotMet' in log
        if 'stopped sending heartbeats' not in log and not gloo_abort:  # the collective noticed first
            assert code == launch.EXIT_WORKER_DIED and errors, log[-2000:]
            assert errors[-1].startswith('error: process 0 of 2: a peer process left the run during a collective')
        assert 'internal error' not in log and 'full traceback in' not in log, log[-2000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_collective_that_loses_its_peer_is_a_dead_worker_not_our_bug(monkeypatch, capsys):
    """The other way a survivor learns its peer died (the test above cannot choose which comes
    first): its own collective fails on the closed connection. That is exit 4 and one line, not
    exit 3 with a traceback file; the same error in a single process stays an internal error."""
    import jax

    from equivalence import cli
    from equivalence.distributed import worker

    gloo = ('INTERNAL: Error dispatching computation: Gloo all-reduce failed: '
            '[external/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:5310')  # fmt: skip

    def work(_):
        raise jax.errors.JaxRuntimeError(gloo)

    monkeypatch.setattr(worker, 'several', lambda: True)
    assert cli.main(lambda argv: None, work, []) == launch.EXIT_WORKER_DIED
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: process 0 of 1: a peer process left the run during a '
                                                   'collective (JaxRuntimeError: INTERNAL: '), lines  # fmt: skip
    monkeypatch.setattr(worker, 'several', lambda: False)
    assert cli.main(lambda argv: None, work, []) == cli.EXIT_INTERNAL
    assert 'full traceback in' in capsys.readouterr().err


def test_a_worker_that_cannot_reach_the_coordinator_fails_within_its_timeout():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    proc = run_module('equivalence.run', '--coordinator', f'127.0.0.1:{port}', '--num-processes', '2',
                      '--process-id', '1', '--init-timeout', '3')  # fmt: skip
    elapsed = time.monotonic() - t0
    assert proc.returncode == launch.EXIT_WORKER_DIED, proc.stderr
    assert elapsed < 3 + 15, elapsed  # the timeout, plus JAX's import on a loaded machine
    lines = message_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith('error: process 1 of 2: no run formed through') and '--init-timeout 3' in lines[0]
    assert 'cannot be reached' in lines[0]


@pytest.mark.parametrize(
    'args, expected',
    [
        (['--processes', '3'], '--devices 8 cannot be split over --processes 3: use --processes in [1, 2, 4, 8]'),
        (['--processes', '0'], '--processes must be at least 1'),
        (['--processes', '2', '--process-id', '0'], '--processes starts its own workers'),
        # Each process would save into a temporary folder of its own; the joint save never completed.
        (['--processes', '2', '--resume-at', '5'], '--resume-at with several processes needs --checkpoint-dir DIR'),
        (['--processes', '2', '--batch-size', '100'], '--batch-size 100 is not divisible by --devices 8'),
    ],
)
def test_bad_process_flags_exit_2_with_one_line(args, expected, capsys):
    """The launcher checks every flag against the whole run before it starts a worker: here in-process,
    through the command's own dispatch: the path a process takes (as a process: test_hostile_ports's launcher, whose
    worker's exit 2 and line reach its stderr)."""
    from equivalence import cli
    from equivalence import run as run_command

    with pytest.raises(SystemExit) as exit_:
        cli.dispatch('equivalence.run', run_command.inputs, run_command.work, args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count('\n') == 1 and err.startswith('error: ') and expected in err, err


def test_a_worker_out_of_its_run_exits_2_with_one_line():
    """A worker's own place is checked before it joins the run: as a process (joining ends the process)."""
    proc = run_module('equivalence.run', '--process-id', '2', '--num-processes', '2')
    assert_one_line_error(proc, '--process-id must be in 0..1, got 2')


def test_the_launcher_gives_workers_the_same_flags_and_their_own_address():
    argv = ['--workload', 'score', '--processes', '2', '--worker-logs=/tmp/x', '--processes=2', '--json', 'r.json']
    assert launch.worker_argv(argv, 1234, 2, 1) == [
        '--workload', 'score', '--json', 'r.json',
        '--coordinator', '127.0.0.1:1234', '--num-processes', '2', '--process-id', '1',
    ]  # fmt: skip
    env = launch.worker_env(4, 1234)
    assert env['JAX_NUM_CPU_DEVICES'] == '4' and env['JAX_COORDINATOR_BIND_ADDRESS'] == '127.0.0.1:1234'


def test_the_one_line_names_what_a_worker_said_in_its_records_else_the_telling_line_of_its_log(tmp_path, monkeypatch):
    """A worker's own ``error:`` line comes back as a JSON record, not read out of its log: whole for bad input
    (exit 2), its detail otherwise; a worker that said nothing (a signal, an abort) is told by its log."""
    from types import SimpleNamespace

    from equivalence.distributed import records

    monkeypatch.setattr(records, 'PATH', launch.records_path(str(tmp_path), 0))
    line = records.error('ValueError: boom', where='process 0', internal=True)
    assert line == 'error: process 0: internal error: ValueError: boom'
    (tmp_path / 'worker-0.log').write_text(f'Traceback (most recent call last):\nValueError: boom\n{line}\n[Gloo] ok\n')
    assert records.last_error(records.PATH) == {'event': 'error', 'line': line, 'detail': 'ValueError: boom'}
    procs, logs = [SimpleNamespace(pid=7), SimpleNamespace(pid=8)], str(tmp_path)
    code, said = launch.failure(procs, [launch.EXIT_INTERNAL, None], 0, logs, 1.25)
    assert code == launch.EXIT_WORKER_DIED
    assert said == ('error: worker 0 of 2 (pid 7) failed with an internal error (ValueError: boom) after 1.2 s; '
                    f'stopped the other 1 with SIGKILL; logs in {logs}')  # fmt: skip
    bad = records.error('--batch-size 100 is not divisible by --devices 8')
    with open(records.PATH, 'a') as f:
        f.write('{"event": "error", "li')  # cut short: the worker was killed while writing it
    assert launch.failure(procs, [launch.EXIT_BAD_INPUT, 0], 0, logs, 1.0) == (launch.EXIT_BAD_INPUT, bad)
    log = tmp_path / 'worker-1.log'
    log.write_text('F1130 04:43:58.073611   23901 client.h:80] Terminating process because ...\n    @ 0x7f frames\n')
    code, said = launch.failure(procs, [0, -signal.SIGABRT], 1, logs, 2.0)
    assert said.startswith('error: worker 1 of 2 (pid 8) was killed by SIGABRT (Terminating process because ...)')
    assert launch.describe(-signal.SIGKILL, '') == 'was killed by SIGKILL'
