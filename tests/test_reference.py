"""A reference: the pmap side recorded once where it ran, the port checked against it ever after
(``python -m equivalence.record``, ``run --reference``; docs/record.md). ``mlp_tpu_v5e.npz`` was recorded on
a TPU v5e chip (jax 0.10.2, D = 1): a CPU check refuses it.

``tests/data/*_jax0.4.38.npz`` were recorded on jax 0.4.38, flax 0.10.2, optax 0.2.4 (the classic pmap, before
jax 0.8 built it on jit and shard_map), CPU, with the command docs/record.md gives; checking one here costs a
few seconds, where making its environment would cost minutes.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, assert_one_line_error, import_example, require_devices
from flax import nnx

from equivalence import RECORDED, LoopPort, devices
from equivalence import record as record_command
from equivalence import run as run_command
from equivalence.core import harness, kinds
from equivalence.core.compare.location import Unplaced
from equivalence.core.compare.outcome import Outcome
from equivalence.core.port import port_fields, workloads
from equivalence.core.port.config import ConfigError, RunConfig
from equivalence.core.port.plan import Plan
from equivalence.core.reference import reference
from equivalence.core.report import render, words
from equivalence.core.run import fits
from equivalence.core.run import inputs as made
from equivalence.testing import PortInputError, PortMismatch, assert_port_matches
from nnx_sharded import losses as nnx_losses

DATA = os.path.join(ROOT, 'tests', 'data')
FLAGS = {'devices': 2, 'steps_per_call': 2, 'calls': 2}
MLP_PORT = os.path.join(ROOT, 'examples', 'mlp_port')


def classic(name: str) -> str:
    return os.path.join(DATA, f'{name}_jax0.4.38.npz')


def test_a_reference_recorded_on_the_classic_pmap_checks_the_port_on_todays_jax():
    """Recorded on jax 0.4.38, checked here: the correct mlp MATCHes, and a 0.1% learning-rate slip MISMATCHes
    at the place a check of both sides on today's JAX names."""
    require_devices(2)
    port, path = workloads.WORKLOADS['mlp'], classic('mlp')
    assert reference.load(path).environment['versions']['jax'] == '0.4.38'
    # the plugin as docs/ci.md writes it: K, C, the batch, the seed and the keys read from the reference
    assert assert_port_matches(port, devices=2, reference=path).outcome is Outcome.MATCH
    with pytest.raises(PortMismatch) as failed:  # the plugin's failure says what the report says
        assert_port_matches(port, reference=path, batch_size=8, perturb=1e-3, **FLAGS)
    slip = failed.value.result
    assert slip.verdict.location.line() in failed.value.report.splitlines()
    assert f'diagnosis ({slip.verdict.kind}): {words.diagnosis(slip.verdict.diagnosis)}' in failed.value.report
    both = harness.check(port, batch_size=8, perturb=1e-3, **FLAGS)  # the control: today's pmap beside it
    assert slip.outcome is both.outcome is Outcome.MISMATCH
    assert slip.verdict.location.kind == both.verdict.location.kind != 'unlocated'


def test_a_port_whose_two_sides_do_not_fit_together_is_refused_before_training_and_checks_against_a_reference(
    monkeypatch, tmp_path
):
    """A device that holds one side's step (its starting train state and the one it returns: the suite's programs
    donate none) but not a check of both sides (three states; its bytes set by ``EQUIVALENCE_DEVICE_BYTES``, as a
    TPU's allocator says its own):
    a check of both sides is one line, exit 2, before its inputs are made, naming the bytes and the way out;
    against a reference, which holds the new side alone, the same port MATCHes, and its report gives the peak
    memory it measured. A device that holds less than one side's step refuses both, naming no way out."""
    require_devices(2)
    port, path = workloads.WORKLOADS['mlp'], classic('mlp')
    one = fits.state_bytes(kinds.of(port), made.unpaired(port, RunConfig(batch_size=8, **FLAGS)).variables)
    monkeypatch.setenv(fits.ENV, str(int(2.5 * one)))
    monkeypatch.setattr(harness, 'both_sides', lambda *a, **k: pytest.fail('trained before refusing'))
    with monkeypatch.context() as m, pytest.raises(ConfigError, match=r'do not fit on one device together.*'
                                                   r'python -m equivalence.record.*--reference'):  # fmt: skip
        m.setattr(harness.made, 'make', lambda *a, **k: pytest.fail('the inputs made before refusing'))
        harness.check(port, batch_size=8, **FLAGS)
    alone = harness.check(port, reference=path, batch_size=8, **FLAGS)
    assert alone.outcome is Outcome.MATCH and alone.timing['memory']['host_peak_bytes'] > 0
    assert 'memory: host peak' in render.text(alone, 'cpu', verbose=True)
    monkeypatch.setenv(fits.ENV, str(int(1.5 * one)))  # not one side's step: said so, with no record to advise
    with pytest.raises(
        ConfigError, match=r'^the new side alone does not fit on this device: its step holds two train states'
    ):
        harness.check(port, reference=path, batch_size=8, **FLAGS)
    with pytest.raises(ConfigError, match=r'^the pmap side alone does not fit(?!.*record)'):
        harness.check(port, batch_size=8, **FLAGS)
    out = tmp_path / 'none.npz'  # nor is it recorded: refused before its inputs are made, nothing written
    with (
        monkeypatch.context() as m,
        pytest.raises(ConfigError, match=r'^the pmap side alone does not fit on this device'),
    ):
        m.setattr(harness.made, 'unpaired', lambda *a, **k: pytest.fail('the inputs made before refusing'))
        harness.record(port, RunConfig(workload='mlp', batch_size=8, **FLAGS), str(out))
    assert not out.exists()
    (team,) = import_example('mlp_port', 'my_port')  # a team's own new step holds what its code holds: one counted
    run = Plan.of(RunConfig(workload='mlp', batch_size=8, **FLAGS)).run
    kind = kinds.of(team.LOOP)
    variables = made.unpaired(team.LOOP, run).variables
    held = fits.state_bytes(kind, variables)
    monkeypatch.setenv(fits.ENV, str(int(1.5 * held)))
    fits.check(kind, run, variables, sides=1)
    with pytest.raises(ConfigError, match=r'^the new side alone does not fit on this device: its step holds its train'):
        monkeypatch.setenv(fits.ENV, str(held // 2))
        fits.check(kind, run, variables, sides=1)


def test_a_references_records_are_cut_to_the_rows_the_recorder_keeps_and_a_batchnorms_kept_whole():
    """A reference recorded with every row is cut as the recorder now cuts (``intercept.sampled``): each device's
    first 8 examples, but a BatchNorm's values whole (its running statistics read every row) and the gradients
    whole. Cut there too, a check against a reference at 16 rows a device stopped at the first BatchNorm, its
    inputs of other shapes on the two sides (`not located: ... the inputs of bn1 <-> bn1 cannot be compared`)."""
    from equivalence.core.locate.recorded_run import rows_kept
    from equivalence.core.record.intercept import GRADS, ROWS
    from equivalence.core.record.recorded import Record

    rows, other = np.arange(16 * 3.0).reshape(16, 3), np.ones((3, 4))
    held = {label: Record(cls, 0, None, {0: ([rows, other], [rows])})
            for label, cls in (('Dense_0', 'Dense'), ('bn1', 'BatchNorm'), (GRADS, 'grads'))}  # fmt: skip
    kept = rows_kept(held, per_device=16)
    (ins, outs) = kept['Dense_0'].values[0]
    assert [a.shape for a in (*ins, *outs)] == [(ROWS, 3), (3, 4), (ROWS, 3)]
    np.testing.assert_array_equal(ins[0], rows[:ROWS])
    for label in ('bn1', GRADS):
        assert [a.shape for a in (*kept[label].values[0][0], *kept[label].values[0][1])] == [(16, 3), (3, 4), (16, 3)]
    assert rows_kept(held, per_device=ROWS) is held  # a batch no larger than what is kept: nothing cut


def test_the_library_reads_the_run_from_the_reference_and_refuses_a_keyword_that_differs(monkeypatch):
    """``equivalence.check(port, reference=FILE)`` and the plugin run what the reference holds (issue 60: the
    plugin's K = C = 2 refused a reference recorded with record's 5 and 4, naming --steps-per-call); a value
    given that differs is refused naming the keyword, as the library spells it."""
    path = classic('mlp')
    ran = []
    monkeypatch.setattr(harness, 'run', lambda port, config, **kwargs: ran.append(config))
    harness.check(workloads.WORKLOADS['mlp'], reference=path)
    recorded = {name: getattr(ran[0], name) for name in reference.FITTED[1:]}
    assert recorded == {'devices': 2, 'steps_per_call': 2, 'calls': 2, 'batch_size': 8, 'seed': 0,
                        'rng_mode': 'per-device'}  # fmt: skip
    with pytest.raises(reference.BadReference) as refused:
        harness.check(workloads.WORKLOADS['mlp'], reference=path, steps_per_call=5)
    assert str(refused.value) == (
        f'reference {path}: recorded with steps_per_call=2, this check gives steps_per_call=5: give steps_per_call=2 '
        'or leave it out (the reference gives it), or record a reference for this check'
    )
    with pytest.raises(PortInputError) as plugin:
        assert_port_matches(workloads.WORKLOADS['mlp'], devices=2, reference=path, calls=4)
    assert 'recorded with calls=2, this check gives calls=4: give calls=2 or leave it out' in str(plugin.value)
    assert '--' not in str(plugin.value).replace(path, '')


def test_across_versions_a_computed_place_is_placed_against_the_pmap_code_run_today_or_not_at_all():
    """A slip in what the step computes (the loss, scaled by 1.001), checked against the 0.4.38 reference: XLA's
    elementwise rounding differs across versions, so the place is found again against the pmap code run on
    today's JAX from the reference's inputs (the loss, as a check of both sides finds it); with the pmap code
    gone (its fields ``RECORDED``), or raising on today's JAX, the MISMATCH stands and no place is named (the
    controls)."""
    require_devices(2)
    port, path = workloads.WORKLOADS['mlp'], classic('mlp')
    scaled = lambda model, batch, noise: 1.001 * nnx_losses.mlp_loss(model, batch, noise)  # noqa: E731
    slip = dataclasses.replace(port, nnx_loss=scaled)
    placed = harness.check(slip, reference=path, batch_size=8, **FLAGS)
    assert placed.outcome is Outcome.MISMATCH and placed.verdict.location.kind == 'loss'
    assert any('jax 0.4.38' in note for note in placed.verdict.location.notes)
    gone = dataclasses.replace(slip, **{field: RECORDED for field in port_fields.LEGACY if getattr(port, field, None)})
    unplaced = harness.check(gone, reference=path, batch_size=8, **FLAGS)
    assert unplaced.outcome is Outcome.MISMATCH and unplaced.verdict.location.why is Unplaced.ACROSS_VERSIONS

    def no_longer_runs(*args):  # the pmap code of an old JAX, which today's raises in (flax.optim, say)
        raise AttributeError("module 'flax' has no attribute 'optim'")

    broken = harness.check(dataclasses.replace(slip, legacy_loss=no_longer_runs), reference=path, batch_size=8, **FLAGS)
    assert broken.outcome is Outcome.MISMATCH and broken.verdict.location.why is Unplaced.ACROSS_VERSIONS


def test_a_check_against_a_reference_draws_its_keys_as_the_recorded_run_drew_them(monkeypatch):
    """score draws its noise from the step's keys, and jax 0.4.38 drew other bits from the same key than
    today's JAX does (``jax_threefry_partitionable``, default since 0.5): as recorded it MATCHes; read as if
    recorded with today's setting, every draw differs and it MISMATCHes (the control)."""
    require_devices(2)
    port, path = workloads.WORKLOADS['score'], classic('score')
    assert reference.load(path).environment['threefry_partitionable'] is False
    assert harness.check(port, reference=path, batch_size=16, **FLAGS).outcome is Outcome.MATCH
    load = reference.load
    today = lambda p: dataclasses.replace(held := load(p), environment={**held.environment,  # noqa: E731
                                                                         'threefry_partitionable': True})  # fmt: skip
    monkeypatch.setattr(reference, 'load', today)
    assert harness.check(port, reference=path, batch_size=16, diagnose=False, **FLAGS).outcome is Outcome.MISMATCH


def damaged_copy(path: str, target) -> str:
    """The reference with one number of one array changed, its manifest (and the sha256 it lists) kept."""
    with np.load(path) as held:
        entries = {k: held[k] for k in held.files}
    name = max((k for k in entries if k != 'manifest'), key=lambda k: entries[k].size)
    changed = entries[name].copy()
    changed.flat[0] = changed.flat[0] + 1
    np.savez(target, **{**entries, name: changed})
    return str(target)


def test_a_damaged_or_ill_fitting_reference_is_refused_before_anything_trains(tmp_path, monkeypatch, capsys):
    require_devices(2)
    port, path = workloads.WORKLOADS['mlp'], classic('mlp')

    def trains(*args, **kwargs):
        raise AssertionError('the new side ran')

    monkeypatch.setattr(harness, 'run_new', trains)
    (tmp_path / 'junk.npz').write_bytes(b'not a zip')
    refused = {
        'damaged': dict(reference=damaged_copy(path, tmp_path / 'damaged.npz'), batch_size=8),
        'another C': dict(reference=path, batch_size=8, calls=3),
        'another batch': dict(reference=path, batch_size=16),
        'another seed': dict(reference=path, batch_size=8, seed=1),
        'not a reference': dict(reference=str(tmp_path / 'junk.npz'), batch_size=8),
        'no file': dict(reference=str(tmp_path / 'none.npz'), batch_size=8),
        'another backend': dict(reference=os.path.join(DATA, 'mlp_tpu_v5e.npz'), batch_size=8, devices=1),
    }
    for why, flags in refused.items():
        with pytest.raises(reference.BadReference):
            harness.check(port, **{**FLAGS, **flags})
        assert why  # each of them refused
    with pytest.raises(reference.BadReference) as another:  # another port, under the same flags
        harness.check(workloads.WORKLOADS['score'], reference=path, batch_size=8, **FLAGS)
    assert f"reference {path}: recorded for the port 'mlp', not 'score' (a port keeps the name" in str(another.value)
    args = ['--workload', 'mlp', '--devices', '2', '--steps-per-call', '2', '--calls', '2', '--batch-size', '8']
    with pytest.raises(SystemExit) as command:  # the command, in-process: run_new still fails if called
        run_command.main([*args, '--reference', refused['damaged']['reference']])
    said = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], command.value.code, said.out, said.err), 'sha256')
    assert said.out == ''


def _rewritten(path: str, target, edit) -> str:
    """The reference at ``path`` written again to ``target`` with its manifest (a dict) changed by ``edit``; arrays
    kept. ``edit`` returns the manifest's new text, or None to drop the entry."""
    with np.load(path) as held:
        entries = {k: held[k] for k in held.files}
    text = edit(json.loads(str(entries.pop('manifest'))))
    np.savez(target, **entries, **({} if text is None else {'manifest': np.array(text)}))
    return str(target)


def _sealed_then_edited(manifest: dict) -> str:
    """As ``record`` writes a manifest now (its own sha256), then one value changed by hand."""
    manifest['manifest_sha256'] = reference._manifest_digest(manifest)
    manifest['config']['seed'] = 1
    return json.dumps(manifest)


def _truncated(path: str, target) -> str:
    data = open(path, 'rb').read()
    target.write_bytes(data[: len(data) // 2])
    return str(target)


def _zip_of_text(target) -> str:
    import zipfile

    with zipfile.ZipFile(target, 'w') as z:
        z.writestr('README.txt', 'the logs of a run')
    return str(target)


def _unreadable(path: str, target) -> str:
    """A copy of the reference no one may read (mode 000; as root, who reads it anyway, the test refuses its
    opening as the kernel refuses it to others)."""
    target.write_bytes(open(path, 'rb').read())
    target.chmod(0)
    return str(target)


def _refused(name, *args, **kwargs):
    raise PermissionError(13, 'Permission denied', name)


def _npy(target) -> str:
    with open(target, 'wb') as f:  # numpy.save would add .npy to the name
        np.save(f, np.zeros(3))
    return str(target)


HOSTILE = {  # what a user may hand over as --reference, and the words that say what it is
    'empty': (lambda p, t: (t.write_bytes(b''), str(t))[1], 'empty (0 bytes)'),
    'a .npy': (lambda p, t: _npy(t), 'one numpy array (.npy, numpy.save), not a reference'),
    'a directory': (lambda p, t: (t.mkdir(), str(t))[1], 'a directory, not a file'),
    'no file': (lambda p, t: str(t), 'no such file'),
    'a pickle': (lambda p, t: (t.write_bytes(__import__('pickle').dumps({'a': 1})), str(t))[1], 'a pickle, which'),
    'a text file': (lambda p, t: (t.write_text('loss 0.5\n'), str(t))[1], "a text file ('loss 0.5'...), not a"),
    'other bytes': (lambda p, t: (t.write_bytes(bytes(range(16))), str(t))[1], 'neither a zip nor a numpy file'),
    'truncated': (_truncated, 'a damaged or truncated zip'),
    'a zip, not npz': (lambda p, t: _zip_of_text(t), 'a zip of 1 entries (README.txt) with no manifest'),
    'an npz, no manifest': (lambda p, t: (np.savez(t, a=np.zeros(2)), str(t))[1], '(a) with no manifest'),
    'unreadable': (_unreadable, 'cannot be read (Permission denied)'),
    'manifest not JSON': (lambda p, t: _rewritten(p, t, lambda m: '{"format": '), 'its manifest is not JSON'),
    'manifest of another format': (
        lambda p, t: _rewritten(p, t, lambda m: json.dumps({**m, 'format': 'orbax'})),
        "not a reference this suite wrote (format 'orbax')",
    ),
    'manifest edited, sealed': (lambda p, t: _rewritten(p, t, _sealed_then_edited), 'its own sha256 fails'),
    'manifest without a field': (
        lambda p, t: _rewritten(p, t, lambda m: json.dumps({k: v for k, v in m.items() if k != 'environment'})),
        'no environment as written',
    ),
    'manifest with its tree cut': (
        lambda p, t: _rewritten(p, t, lambda m: json.dumps({**m, 'tree': {'dict': []}})),
        'does not read as a recording (KeyError',
    ),
}


@pytest.mark.parametrize('case', list(HOSTILE))
def test_each_bad_reference_a_user_can_hand_over_is_one_line_saying_what_it_is(case, tmp_path, monkeypatch):
    """Issue 60: a 0-byte file, a .npy, a step without loss= were exit 3, a directory 'no such file'. Each hostile
    file is refused (exit 2's ``ConfigError``) before anything trains, with one line saying what it is."""
    require_devices(2)
    make, words = HOSTILE[case]
    monkeypatch.setattr(harness, 'run_new', lambda *a, **k: pytest.fail('the new side ran'))
    path = make(classic('mlp'), tmp_path / 'loop.npz')
    if case == 'unreadable' and os.geteuid() == 0:  # root reads any file: its opening refused here instead
        monkeypatch.setattr(reference, 'open', _refused, raising=False)
    with pytest.raises(reference.BadReference) as refused:
        harness.check(workloads.WORKLOADS['mlp'], reference=path, batch_size=8, **FLAGS)
    line = str(refused.value)
    assert line.startswith(f'reference {path}: ') and words in line and '\n' not in line, line


def _metrics_step(ts, batch):
    """A new step returning a metrics dict, its loss under 'loss'."""
    model, optimizer = ts
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(nnx_losses.mlp_loss(m, batch, None)))(model)
    optimizer.update(model, grads)
    return ts, {'loss': loss}


def test_a_new_step_whose_loss_it_does_not_say_is_refused_against_a_reference(monkeypatch):
    """A check against a reference traces the new side's half of the pre-flight: a step returning metrics with
    no ``loss=`` was exit 3 (``float()`` of a dict) after the new side ran; now the line a check of both sides
    says. Given ``loss='loss'`` the same port is accepted (the control)."""
    require_devices(2)
    monkeypatch.setattr(harness, 'run_new', lambda *a, **k: pytest.fail('the new side ran'))
    port = LoopPort(name='mlp', legacy_model=RECORDED, make_data=RECORDED, init_args=RECORDED, legacy_state=RECORDED,
                    legacy_step=RECORDED, nnx_model=workloads.WORKLOADS['mlp'].nnx_model, step_form='state',
                    new_state=lambda m: (m, nnx.Optimizer(m, workloads.mlp_tx(), wrt=nnx.Param)),
                    new_step=nnx.jit(_metrics_step))  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        harness.check(port, reference=classic('mlp'), batch_size=8, **FLAGS)
    assert str(refused.value) == (
        "port 'mlp': new_step returns metrics ['loss'], and the port gives no loss=: name the one that is the loss "
        "(loss='loss'), or give a function of them"
    )
    with pytest.raises(pytest.fail.Exception, match='the new side ran'):
        harness.check(dataclasses.replace(port, loss='loss'), reference=classic('mlp'), batch_size=8, **FLAGS)


CHECKS = """
import json, shlex, sys
sys.modules['legacy_code'] = None  # the pmap code is gone: importing it raises
from equivalence.run import main
codes = [main(shlex.split(sys.argv[3])[3:]),  # as record says to check it: the run's flags read from the reference
         main(['--workload', 'new_only:LOOP_EPSILON_SLIP', '--reference', sys.argv[1], '--json', sys.argv[2]])]
try:
    main(['--workload', 'new_only:LOOP', '--devices', '2', '--steps-per-call', '2', '--calls', '2'])
except SystemExit as e:
    codes.append(e.code)
print(json.dumps(codes))
"""


def test_a_port_whose_pmap_code_is_gone_is_checked_against_the_reference_recorded_while_it_ran(tmp_path):
    """examples/mlp_port: ``my_port:LOOP`` recorded, then ``new_only`` (every pmap field ``RECORDED``) checked in
    a process where ``legacy_code`` cannot be imported: MATCH, and its LayerNorm epsilon slip MISMATCH at the
    module; without a reference such a port is refused (exit 2). A reference is never overwritten unasked."""
    require_devices(2)
    ref, report = str(tmp_path / 'loop.npz'), str(tmp_path / 'slip.json')
    (port,) = import_example('mlp_port', 'my_port')
    config = RunConfig(workload=port.LOOP.name, devices=2, steps_per_call=2, calls=2, batch_size=64,
                       rng_mode='global')  # fmt: skip
    harness.record(port.LOOP, config, ref)
    written = open(ref, 'rb').read()
    with pytest.raises(SystemExit) as again:  # an existing reference is replaced only with --overwrite
        record_command.main(['--workload', 'mlp', '--devices', '2', '--out', ref])
    assert again.value.code == 2 and open(ref, 'rb').read() == written
    env = devices.without_device_count(dict(os.environ))  # its own count; the tests' XLA level kept (conftest)
    said = record_command.check_command('new_only:LOOP', ref)  # what record says, checked as it says it
    assert said == f'python -m equivalence.run --workload new_only:LOOP --reference {ref}'
    proc = subprocess.run([sys.executable, '-c', CHECKS, ref, report, said], cwd=MLP_PORT, capture_output=True,
                          text=True, timeout=300, env={**env, 'PYTHONPATH': ROOT})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [0, 1, 2]
    with open(report) as f:
        location = json.load(f)['verdict']['location']
    assert (location['kind'], location['new']) == ('module', 'norm')


def test_on_an_old_jax_only_the_recorder_runs(monkeypatch, capsys):
    """In a team's jax 0.4 environment (where the package's ranges let it install beside their JAX), every
    command but record is refused up front, exit 2, before anything imports the port; record goes on."""
    from equivalence import compat
    from equivalence import run as run_command

    monkeypatch.setattr(compat, 'version', lambda package='jax': (0, 4, 38))
    with pytest.raises(SystemExit) as refused:
        run_command.main(['--workload', 'mlp'])
    said = capsys.readouterr().err
    assert refused.value.code == 2 and '0.4.38' in said
    # what it says to install is this suite, from its checkout (the package is on no registry)
    assert f"pip install -e '{ROOT}[check]'" in said and 'pmap-to-nnx-equivalence[' not in said, said
    with pytest.raises(SystemExit) as bad_flag:  # record is not refused for its JAX: its own flags are read
        record_command.main(['--workload', 'mlp', '--devices', '0', '--out', 'x.npz'])
    assert bad_flag.value.code == 2 and '0.4.38' not in capsys.readouterr().err


def test_the_guide_names_every_field_a_port_gives_as_recorded():
    """docs/record.md said 'give every field of the pmap side as RECORDED' and named none: it names each field
    ``RECORDED`` stands for (``port_fields.LEGACY``)."""
    with open(os.path.join(ROOT, 'docs', 'record.md')) as f:
        section = f.read().split('## After the pmap code is gone', 1)[1].split('\n## ', 1)[0]
    assert [field for field in port_fields.LEGACY if f'`{field}`' not in section] == []


def test_the_guide_says_where_where_names_no_module_beside_its_claim_that_it_does():
    """Only the reference's guide said that against an old JAX's reference, its pmap code gone, no place in what
    the step computes is named: the paragraph of docs/where.md that shows ``where:`` naming a module says it."""
    with open(os.path.join(ROOT, 'docs', 'where.md')) as f:
        paragraph = next(p for p in f.read().split('\n\n') if '`where: module at' in p)
    assert 'is not named' in paragraph and '(record.md#what-the-jax-upgrade-changed)' in paragraph


def test_a_bfloat16_leaf_is_kept_with_its_type_and_its_bits(tmp_path):
    """numpy's .npy keeps no name for ml_dtypes' types: a bfloat16 momentum (the ViT example's) came back as
    2-byte voids whose sha256 failed ('damaged since it was recorded') on every reference that held one. Its
    bits are kept as unsigned integers of its width, its type by name."""
    import ml_dtypes

    momentum = (np.arange(6, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16)
    path = str(tmp_path / 'bf16.npz')
    reference.save(path, RunConfig(batch_size=8, **FLAGS), 'mlp', {'mu': momentum, 'w': np.ones(3, np.float32)})
    held = reference.load(path)
    back = held.content({})
    assert back['mu'].dtype == ml_dtypes.bfloat16 and np.array_equal(
        back['mu'].view(np.uint16), momentum.view(np.uint16)
    )
