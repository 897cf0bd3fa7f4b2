"""The command line: ``run`` end to end in a subprocess (exit 0, 1, 2), every command's validation
in-process, and exit 3 for an internal error."""

import functools
import importlib
import json
import os
import re
import subprocess
import tempfile

import jax
import pytest
from conftest import assert_one_line_error, run_module
from readme_sample import assert_first_screen, assert_sample

from equivalence import cli
from equivalence.core.compare import compare
from equivalence.core.compare.outcome import Outcome
from equivalence.core.port.config import ConfigError
from equivalence.core.twins.twin import PROGRAM_TWIN

QUICK = ['--steps-per-call', '2', '--calls', '2']


def equivalence_run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_module('equivalence.run', *args, env=env)


def test_match_exits_0_on_8_simulated_devices_and_writes_json_and_plots(tmp_path):
    """The default run, as the README shows it (its sample report is this run's, figures masked)."""
    out, figures = tmp_path / 'report.json', tmp_path / 'figures'
    proc = equivalence_run('--json', str(out), '--plot', str(figures))
    assert proc.returncode == 0, proc.stderr
    assert 'compiled calls' not in proc.stderr  # no progress bar when stderr is not a terminal
    assert 'on 8 cpu device(s)' in proc.stdout and 'MATCH' in proc.stdout
    assert_sample('', proc.stdout)
    assert_first_screen(proc.stdout, json.loads(out.read_text()))
    report = json.loads(out.read_text())
    assert report['match'] is True and report['workload'] == 'mlp'
    assert report['devices'] == 8 and report['steps'] == 20
    with open(os.path.join(os.path.dirname(__file__), '..', 'docs', 'json.md')) as f:  # its reference names every key
        guide = f.read()
    keys = [*report, *report['verdict'], *report['timing']]
    assert [key for key in keys if f'`{key}`' not in guide] == []
    assert len(report['losses']['legacy']) == len(report['losses']['new']) == 20
    assert set(report['max_abs_diff']) >= {'params', 'opt_state', 'losses'}
    assert all(isinstance(v, float) for v in report['max_abs_diff'].values())
    tol = compare.FLOAT32_REDUCTION_ORDER  # the fixed screen's, as it is
    assert report['tolerance'] == {'rtol': tol.rtol, 'atol': tol.atol, 'reason': tol.reason}
    assert report['verdict']['mode'] == 'measured' and report['verdict']['twin'] == PROGRAM_TWIN
    assert report['verdict']['floor_rule']['safety'] > 1 and report['verdict']['kind'] == ''
    pngs = {name: (figures / name).read_bytes() for name in ('losses.png', 'divergence.png')}
    assert all(data.startswith(b'\x89PNG') and len(data) > 10_000 for data in pngs.values())
    again = equivalence_run('--plot', str(figures))  # figures are kept unless --overwrite
    assert again.returncode == 2 and again.stderr.count('\n') == 1 and not again.stdout  # refused before any work
    assert all((figures / name).read_bytes() == data for name, data in pngs.items())


def test_perturbed_learning_rate_exits_1(tmp_path):
    """The negative control of the run above, and mlp's of ``test_equivalence``: a 0.01% learning-rate
    change on the NNX side is caught in the parameters and the losses (the README's sample MISMATCH)."""
    out = tmp_path / 'report.json'
    proc = equivalence_run('--perturb', '1e-4', '--json', str(out))
    assert proc.returncode == 1, proc.stderr
    assert_sample('--perturb 1e-4', proc.stdout)
    assert_first_screen(proc.stdout, json.loads(out.read_text()))
    report = json.loads(out.read_text())
    assert report['match'] is False and report['outcome'] == Outcome.MISMATCH.label
    assert {'params', 'losses'} <= {leaf['name'].split('/')[0] for leaf in report['leaves'] if not leaf['ok']}


def test_bad_input_exits_2_with_one_line():
    """As a process: more devices than this shell's JAX sees (the rows below are the same path in-process)."""
    proc = equivalence_run('--devices', '16')
    assert_one_line_error(proc, 'JAX_NUM_CPU_DEVICES=16')


def test_existing_report_is_not_overwritten_without_asking(tmp_path, capsys):
    """Refused by run's own validation, in-process (the same refusal as a process: ``--plot`` in the match
    test above)."""
    out = tmp_path / 'report.json'
    out.write_text('precious')
    with pytest.raises(SystemExit) as exit_:
        validate('run', [*QUICK, '--json', str(out)])
    assert exit_.value.code == 2 and 'pass --overwrite' in capsys.readouterr().err
    assert out.read_text() == 'precious'


# ---- every command: the issue's table of inputs, validated in-process through the commands' own path ----

COMMANDS = {
    'run': 'equivalence.run',
    'explain': 'equivalence.explain.__main__',
    'bench': 'equivalence.bench.__main__',
    'pitfalls': 'equivalence.pitfalls.__main__',
}


def validate(command: str, argv: list[str], n_available: int = 8):
    """What the command does before any work: its inputs, or SystemExit with the one-line error printed."""
    module = importlib.import_module(COMMANDS[command])
    return cli.validate(functools.partial(module.inputs, n_available=n_available), argv)


ISSUE_TABLE = [
    (['--devices', '0'], '--devices must be at least 1, got 0'),
    (['--batch-size', '0'], '--batch-size must be at least 1, got 0'),
    (['--seed', '-1'], '--seed must be in 0 .. 4294967295'),
    (['--seed', '99999999999999999999'], '--seed must be in 0 .. 4294967295'),
    (['--devices', '9'], 'more devices than the 8 available'),
    (['--steps-per-call', '0'], '--steps-per-call must be at least 1'),
    (['--calls', '0'], '--calls must be at least 1'),  # (as a process: test_bad_input_exits_2_with_one_line, the
    (['--rng', 'sometimes'], '--rng must be one of'),  # one row that needs a fresh shell's JAX device count)
    (['--devices', 'many'], "invalid int value: 'many'"),  # argparse's own
    (['--workload', 'resnet'], "unknown workload 'resnet'"),
]


@pytest.mark.parametrize('command', ['run', 'explain', 'bench'])
@pytest.mark.parametrize('args, expected', ISSUE_TABLE)
def test_issue_table_rows_exit_2_with_one_line(command, args, expected, capsys):
    with pytest.raises(SystemExit) as exit_:
        validate(command, args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count('\n') == 1 and err.startswith('error: ') and expected in err, err


def test_an_unknown_verdict_mode_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        validate('run', ['--verdict', 'loose'])
    assert exit_.value.code == 2 and '--verdict must be one of measured, strict, screen' in capsys.readouterr().err


@pytest.mark.parametrize('value', ['nan', 'inf', '-inf', '-1', '1e4'])
def test_perturb_must_be_finite_above_minus_one(value, capsys):
    with pytest.raises(SystemExit):
        validate('run', [f'--perturb={value}'])
    assert capsys.readouterr().err.startswith('error: --perturb must be a finite number above -1')


def test_negative_exponent_is_a_value_not_a_flag():
    config = validate('run', ['--perturb', '-1e-3'])[2]
    assert config.perturb == -1e-3


@pytest.mark.parametrize('command', list(COMMANDS))
def test_json_directory_is_refused_even_with_overwrite(command, tmp_path, capsys):
    with pytest.raises(SystemExit):
        validate(command, ['--json', str(tmp_path), '--overwrite'])
    assert capsys.readouterr().err == f'error: --json {tmp_path} is a directory; give a file name\n'


def test_suggestions_name_only_device_counts_that_exist(capsys):
    with pytest.raises(SystemExit):
        validate('run', ['--batch-size', '60', '--devices', '8'], n_available=8)
    assert capsys.readouterr().err.endswith('use --batch-size 56 or 64, or --devices in [1, 2, 3, 4, 5, 6]\n')
    with pytest.raises(SystemExit):
        validate('run', ['--batch-size', '62', '--devices', '4'], n_available=4)
    assert capsys.readouterr().err.endswith('use --batch-size 60 or 64, or --devices in [1, 2]\n')


def test_defaults_are_only_used_when_a_flag_is_not_given():
    config = validate('run', [], n_available=4)[2]
    assert (config.devices, config.batch_size) == (4, 64)
    config = validate('run', ['--workload', 'score', '--devices', '2'], n_available=4)[2]
    assert (config.devices, config.batch_size) == (2, 128)


# ---- exit 3: an internal failure never reads as a verdict ----


@pytest.mark.parametrize('command', list(COMMANDS))
def test_injected_internal_error_exits_3_with_one_line_and_the_traceback_in_a_file(command, tmp_path):
    env = {cli.INJECT_INTERNAL_ERROR: '1', 'TMPDIR': str(tmp_path)}  # tempfile writes the traceback there
    proc = run_module(COMMANDS[command].removesuffix('.__main__'), env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(cli.INTERNAL) and 'RuntimeError: injected' in line, line
    path = line.rsplit('full traceback in ', 1)[1]
    assert os.path.dirname(path) == str(tmp_path)
    text = open(path).read()
    assert text.startswith(f'command: python -m {COMMANDS[command].removesuffix(".__main__")}')
    assert (
        'Traceback (most recent call last)' in text
        and f'RuntimeError: injected by {cli.INJECT_INTERNAL_ERROR}=1' in text
    )


def test_what_the_tests_keep_in_a_temporary_folder_is_the_sessions_removed_after_it():
    """A process a test starts keeps its exit 3's traceback in this session's temporary folder (conftest), which
    is removed when the session ends: before, the suite's tests left tracebacks and workers' logs in the system's."""
    session = os.environ.get('EQUIVALENCE_TESTS_TMP')
    assert session and tempfile.gettempdir() == session != os.path.dirname(session)
    proc = run_module('equivalence.run', env={cli.INJECT_INTERNAL_ERROR: '1'})
    assert proc.returncode == 3, proc.stderr
    path = proc.stderr.strip().rsplit('full traceback in ', 1)[1]
    assert os.path.dirname(path) == session and os.path.isfile(path)
    os.unlink(path)


def test_main_maps_every_outcome_to_its_exit_code(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli.devices, 'simulate_cpu_devices', lambda: None)  # JAX is already up in this process
    inputs = lambda argv: argv

    def work(argv):
        raise argv[0]

    assert cli.main(inputs, lambda argv: 1, ['x']) == 1
    assert cli.main(inputs, work, [KeyboardInterrupt()]) == cli.EXIT_INTERRUPTED
    assert capsys.readouterr().err == 'interrupted\n'
    with pytest.raises(SystemExit) as exit_:
        cli.main(inputs, work, [ConfigError('needs scikit-learn')])
    assert exit_.value.code == 2 and capsys.readouterr().err == 'error: needs scikit-learn\n'
    tpu = (
        'RESOURCE_EXHAUSTED: E0100: RuntimeBufferAllocationFailure: Error allocating device buffer: Attempting '
        'to allocate 6.25M. That was not possible. There are 5.81M free.; (0x0x0_HBM0) See ...'
    )  # a TPU's, as said
    with pytest.raises(SystemExit) as exit_:  # a device out of memory: its size, not a bug of the suite's
        cli.main(inputs, work, [jax.errors.JaxRuntimeError(tpu)])
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith(
        'error: the device ran out of memory (Attempting to allocate 6.25M. That was not possible. There are 5.81M '
        'free.): the programs the suite builds donate no train state'
    )
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
    assert cli.main(inputs, work, [ValueError('boom\nsecond line')]) == 3
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(cli.INTERNAL) and f'(ValueError: boom second line); full traceback in {tmp_path}' in line
    assert 'Traceback (most recent call last)' in open(line.rsplit('full traceback in ', 1)[1]).read()


# The exit codes each command can end with: 4 only where several processes can run (a worker died),
# 1 only where there is a verdict or a case to fail, 5 only run's; 130 (Ctrl-C) everywhere (cli.main).
CODES = {
    ('equivalence.run', ()): {0, 1, 2, 3, 4, 5, 130},
    ('equivalence.explain.__main__', ()): {0, 2, 3, 4, 130},
    ('equivalence.bench.__main__', ()): {0, 2, 3, 4, 130},
    ('equivalence.pitfalls.__main__', ()): {0, 1, 2, 3, 130},  # one process: no worker can die
    ('equivalence.corpus.__main__', ()): {0, 1, 2, 3, 130},
    ('equivalence.checkpoint.__main__', ()): {0, 2, 3, 130},
    ('equivalence.checkpoint.__main__', ('migrate',)): {0, 2, 3, 130},
    ('equivalence.checkpoint.__main__', ('verify',)): {0, 2, 3, 130},
}
ALL_CODES = {0, 1, 2, 3, 4, 5, 130}


def listed_codes(text: str) -> set[int]:
    """The codes an ``exit codes:`` paragraph lists, one per line: ``  0  every leaf ...``."""
    paragraph = text.split('exit codes:', 1)[1].split('\n\n', 1)[0]
    return {int(m) for m in re.findall(r'^  (\d+)  ', paragraph, flags=re.M)}


@pytest.mark.parametrize('module, sub', list(CODES), ids=[' '.join((m, *s)) for m, s in CODES])
def test_help_lists_exactly_the_exit_codes_the_command_can_give(module, sub, capsys):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).parse([*sub, '--help'])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert listed_codes(out) == CODES[module, sub], out
    for code in ('2  bad input', '3  internal error: a bug in this suite, not a verdict on the port', '130  '):
        assert '\n  ' + code in out, out
    if module == 'equivalence.explain.__main__':
        assert 'explain compiles one call' in ' '.join(out.split())


def test_python_m_equivalence_lists_every_exit_code(capsys):
    from equivalence.__main__ import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert listed_codes(out) == ALL_CODES, out
    assert 'NOT VERIFIED' in out and 'interrupted' in out


# Every command's --help names a port as package.module:NAME: test_docs.py, in-process (the process's start is
# this file's other commands').


def test_xla_warnings_are_off_unless_the_user_set_their_level(monkeypatch):
    """The recorded first step gathers sharded values for the host, and XLA's partitioner warned once per
    value ('Involuntary full rematerialization': 48 to 246 lines under a correct MATCH of a port tried
    blind): every command and the plugin turn XLA's warnings off before JAX starts, its errors kept; a
    level the user set is theirs."""
    from equivalence import devices

    monkeypatch.delenv('TF_CPP_MIN_LOG_LEVEL', raising=False)
    devices.quiet_xla_warnings()
    assert os.environ['TF_CPP_MIN_LOG_LEVEL'] == '2'
    monkeypatch.setenv('TF_CPP_MIN_LOG_LEVEL', '0')
    devices.quiet_xla_warnings()
    assert os.environ['TF_CPP_MIN_LOG_LEVEL'] == '0'
    called = []
    monkeypatch.setattr(devices, 'quiet_xla_warnings', lambda: called.append(True))
    cli.main(lambda argv: None, lambda inputs: 0, [])
    assert called, 'cli.main does not quiet XLA'
