"""``python -m equivalence.run`` end to end, in a subprocess: exit codes 0, 1 and 2."""

import json
import subprocess

import pytest
from conftest import assert_one_line_error, run_module

QUICK = ['--steps-per-call', '2', '--calls', '2']


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_module('equivalence.run', *args, env=env)


def test_match_exits_0_on_8_simulated_devices_and_writes_json(tmp_path):
    out = tmp_path / 'report.json'
    proc = cli(*QUICK, '--json', str(out))
    assert proc.returncode == 0, proc.stderr
    assert 'on 8 cpu device(s)' in proc.stdout and 'MATCH' in proc.stdout
    report = json.loads(out.read_text())
    assert report['match'] is True and report['workload'] == 'mlp'
    assert report['devices'] == 8 and report['steps'] == 4
    assert len(report['losses']['legacy']) == len(report['losses']['nnx']) == 4
    assert set(report['max_abs_diff']) >= {'params', 'opt_state', 'losses'}
    assert all(isinstance(v, float) for v in report['max_abs_diff'].values())
    assert report['tolerance']['reason'].startswith('float32 reduction order')


def test_perturbed_learning_rate_exits_1(tmp_path):
    out = tmp_path / 'report.json'
    proc = cli(*QUICK, '--perturb', '1e-3', '--json', str(out))
    assert proc.returncode == 1, proc.stderr
    assert 'MISMATCH' in proc.stdout
    assert json.loads(out.read_text())['match'] is False


@pytest.mark.parametrize(
    'args, expected',
    [
        (['--batch-size', '100'], 'use --batch-size 96 or 104, or --devices in [1, 2, 4, 5]'),
        (['--devices', '16'], 'JAX_NUM_CPU_DEVICES=16'),
        (['--steps-per-call', '0'], '--steps-per-call must be at least 1'),
        (['--calls', '0'], '--calls must be at least 1'),
        (['--workload', 'resnet'], "unknown workload 'resnet'"),
        (['--rng', 'sometimes'], '--rng must be one of'),
        (['--devices', 'many'], "invalid int value: 'many'"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, expected):
    proc = cli(*args)
    assert 'Traceback' not in proc.stderr
    assert_one_line_error(proc, expected)


def test_existing_report_is_not_overwritten_without_asking(tmp_path):
    out = tmp_path / 'report.json'
    out.write_text('precious')
    proc = cli(*QUICK, '--json', str(out))
    assert proc.returncode == 2 and 'pass --overwrite' in proc.stderr
    assert out.read_text() == 'precious'
