"""The migration checked from the team's own test suite: `python -m pytest` in this folder.

The jit step's mesh is built from ``jax.devices()`` when ``jit_code`` is imported, so each device
count runs in a process of its own that sees that many devices, as the workload itself would run."""

import json
import os
import subprocess
import sys

import pytest


def run(name: str, devices: int, tmp_path) -> tuple[int, dict]:
    """``python -m equivalence.run --workload my_port:NAME --devices D`` where JAX sees D devices."""
    report = tmp_path / 'report.json'
    env = {**os.environ, 'JAX_NUM_CPU_DEVICES': str(devices)}
    argv = ['--workload', f'my_port:{name}', '--devices', str(devices), '--steps-per-call', '2', '--calls', '2']
    proc = subprocess.run([sys.executable, '-m', 'equivalence.run', *argv, '--json', str(report)],
                          cwd=os.path.dirname(os.path.abspath(__file__)), env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc.returncode, json.loads(report.read_text())


@pytest.mark.parametrize('devices', [1, 2, 4, 8], ids=lambda d: f'D{d}')
def test_port_matches(devices, tmp_path):
    code, report = run('PORT', devices, tmp_path)
    assert code == 0 and report['match'], [leaf for leaf in report['leaves'] if not leaf['ok']]
    # a twin on another device count, in a fresh process (the mesh is built from jax.devices() at import),
    # measured this port's own noise floor: not the fixed screen
    assert report['verdict']['floor_rule'] is not None, report['verdict']['done']
    assert 'in a fresh process' in report['verdict']['twin'], report['verdict']['twin']


def test_a_slip_is_caught(tmp_path):
    """The jit side's warmup over 5 steps where the pmap side's took 4: other learning rates from step 2."""
    code, report = run('PORT_WARMUP_SLIP', 2, tmp_path)
    assert code == 1 and not report['match']
    assert report['verdict']['floor_rule'] is not None and report['verdict']['kind'] != 'unmeasured', report['verdict']
    assert any(leaf['name'].startswith('params/') and not leaf['ok'] for leaf in report['leaves'])
