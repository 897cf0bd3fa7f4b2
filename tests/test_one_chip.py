"""A check where one accelerator chip is all there is (issue 50): one device, and no second process (a
second process cannot open a TPU chip that the first holds, and a GPU's first process holds 75% of its
memory). Emulated on the CPU, as a TPU host behaves: a fresh process that sees 1 device, in which every way
of starting a process raises (``FORBID``). The floor is the run's own program (``--twin program``): a
measured MATCH, a 1e-5 learning-rate slip a MISMATCH. The negative control: the device-count twin
(``--twin devices``) there has no second mesh and no fresh process, so no floor: NOT VERIFIED.
"""

import json
import os
import subprocess
import sys

from equivalence import devices
from tests.conftest import ROOT

FORBID = """
import os, subprocess, multiprocessing
def _no(*a, **k):
    raise OSError('no process may be started here (a TPU host: one program holds the chip)')
subprocess.Popen.__init__ = _no
for name in ('fork', 'forkpty', 'posix_spawn', 'posix_spawnp', 'spawnv', 'spawnve', 'execv', 'execve', 'system'):
    if hasattr(os, name):
        setattr(os, name, _no)
multiprocessing.Process.start = _no
import sys
from equivalence import run
sys.exit(run.main(sys.argv[1:]))
"""


def one_chip(tmp_path, *flags: str) -> tuple[int, dict]:
    """``python -m equivalence.run --devices 1 FLAGS`` in a process that sees one device and may start none."""
    env = devices.without_device_count(dict(os.environ))  # the tests' XLA level kept (conftest)
    report = tmp_path / f'{len(list(tmp_path.iterdir()))}.json'
    proc = subprocess.run(
        [sys.executable, '-c', FORBID, '--devices', '1', '--steps-per-call', '2', '--calls', '2', '--json', str(report),
         *flags],
        cwd=ROOT, env={**env, 'JAX_NUM_CPU_DEVICES': '1'}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode in (0, 1, 5), proc.stderr[-2000:]
    return proc.returncode, json.loads(report.read_text())


def test_one_device_and_no_process_gives_a_measured_verdict(tmp_path):
    code, report = one_chip(tmp_path)
    assert code == 0 and report['outcome'] == 'MATCH'
    twins = [s for s in report['timing']['stages'] if s['name'].startswith('twin ')]
    assert len(twins) == 2 and all(s['programs'] == 0 for s in twins)  # the run's own program: none compiled
    assert all(leaf['floor'] is not None for leaf in report['leaves'] if leaf['name'].startswith('params/'))
    slip, _ = one_chip(tmp_path, '--perturb', '1e-5')
    assert slip == 1
    devices_twin, _ = one_chip(tmp_path, '--twin', 'devices')
    assert devices_twin == 5  # no second mesh and no fresh process: no floor, no verdict


def test_on_an_accelerator_a_check_computes_at_highest_and_says_the_default_precisions_gap_when_asked(monkeypatch):
    """On an accelerator (the backend said to be a TPU here; the CPU computes float32 in float32 at every
    precision) a check runs at ``highest`` and says so in the header and the JSON's ``device``. The gap at the
    default precision costs both sides once more (28% of a check on the chip, issue 59): it is run only when
    asked (``default_gap``, ``--default-gap``), and the header says how to ask; asked, the figure is said, not
    judged. ``--precision highest`` never runs it; the CPU, as it is, computes at its default and says nothing."""
    import jax

    from equivalence.core import harness
    from equivalence.core.port import workloads
    from equivalence.core.report import render

    small = {'devices': 2, 'steps_per_call': 2, 'calls': 2}
    on_cpu = harness.check(workloads.get('mlp'), **small)
    assert on_cpu.device.precision == 'default' and on_cpu.device.default_gap is None
    assert 'precision' not in render.header(on_cpu, 'cpu')
    monkeypatch.setattr(jax, 'default_backend', lambda: 'tpu')
    result = harness.check(workloads.get('mlp'), **small)
    said = render.to_json(result, {})['device']
    assert said['backend'] == 'tpu' and said['precision'] == 'highest' and result.outcome.label == 'MATCH'
    assert said['default_gap'] is None and '--default-gap' in render.header(result, 'tpu')
    assert not any('default precision' in s['name'] for s in result.timing['stages'])
    asked = harness.check(workloads.get('mlp'), default_gap=True, **small)
    assert set(render.to_json(asked, {})['device']['default_gap']) == {'losses', 'first_loss', 'params'}
    assert 'at highest precision' in render.header(asked, 'tpu')
    assert any('default precision' in s['name'] for s in asked.timing['stages'])
    highest = harness.check(workloads.get('mlp'), precision='highest', default_gap=True, **small)
    assert highest.device.precision == 'highest' and highest.device.default_gap is None
