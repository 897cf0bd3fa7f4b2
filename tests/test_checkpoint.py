"""Checkpoints across the port: legacy saves through Orbax, ``migrate`` converts, NNX resumes on
any mesh as if it had never stopped; and the faults (a killed writer, damaged files, a state of
another workload), each failing when its protection is removed."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, assert_one_line_error, message_lines, require_devices, run_module
from flax import nnx

from equivalence import run as run_command
from equivalence.checkpoint import __main__ as checkpoint_command
from equivalence.checkpoint import layout, migrate, resume, store
from equivalence.checkpoint.options import CheckpointOptions
from equivalence.core import harness, kinds
from equivalence.core.compare.findings import Finding, LegacyTwin, NotRun, Probe, Screen, Twins
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.run import inputs as made
from equivalence.core.run import sides
from equivalence.core.run.nudge import DRAWS
from legacy_pmap import checkpoints as legacy_checkpoints
from legacy_pmap import models as legacy_models
from nnx_sharded import checkpoints as nnx_checkpoints
from nnx_sharded import models as nnx_models
from nnx_sharded import sharding, train

EXAMPLE = os.path.join(ROOT, 'examples', 'mlp_port')
sys.path.insert(0, EXAMPLE)
import my_port  # noqa: E402  (the example, imported as a user's module)

DONE_WHEN = ['--resume-at', '10', '--steps-per-call', '5', '--calls', '4']
MLP, SCORE = workloads.WORKLOADS['mlp'], workloads.WORKLOADS['score']


def wider_mlp(hidden: int):
    """The mlp workload with another hidden width: a checkpoint of the usual one does not fit it."""
    return dataclasses.replace(
        MLP,
        legacy_model=lambda: legacy_models.MLP(hidden=hidden),
        nnx_model=lambda rngs: nnx_models.MLP(hidden=hidden, rngs=rngs),
    )


# -- the Done-when runs: legacy saves at 10, migrated, NNX resumes for 10 more ---------------------


@pytest.fixture(scope='module')
def done_when(tmp_path_factory) -> dict:
    """``run --resume-at 10 --steps-per-call 5 --calls 4`` on mlp, score and cnn, checkpoints kept."""
    runs = {}
    for name in ('mlp', 'score', 'cnn'):
        root = tmp_path_factory.mktemp(name)
        args = ['--workload', name, *DONE_WHEN, '--checkpoint-dir', str(root), '--json', str(root / 'report.json')]
        runs[name] = (run_command.main(args), json.loads((root / 'report.json').read_text()), root)
    return runs


@pytest.mark.parametrize('name', ['mlp', 'score', 'cnn'])
def test_resume_at_10_matches_legacy_trained_20_steps_without_stopping(done_when, name):
    code, report, root = done_when[name]
    assert code == 0 and report['match'], report['leaves']
    assert report['resumed_at'] == 10 and len(report['losses']['new']) == 10
    assert sorted(os.listdir(root / 'legacy')) == ['10', '20']  # every 2 calls, as --resume-at 10 implies
    assert '_CHECKPOINT_METADATA' in os.listdir(root / 'legacy' / '10')  # Orbax's layout, finalised
    assert os.listdir(root / 'nnx') == ['10']
    print(name, {g: f'{v:.1e}' for g, v in report['max_abs_diff'].items()})


def _flat_legacy(port, directory: str, step: int) -> dict[str, np.ndarray]:
    state, _, _ = store.read_legacy(directory, legacy_checkpoints.abstract_state(layout.legacy_init(port)), step)
    groups = layout.legacy_groups(port)(state)
    return {f'{g}/{p}': a for g, tree in groups.items() if tree is not None for p, a in _paths(tree).items()}


def _paths(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {legacy_checkpoints.path_str(p): np.asarray(a) for p, a in leaves}


def _read_nnx(port, directory: str, devices: int, step: int | None = None) -> dict[str, jax.Array]:
    _, target = nnx_checkpoints.abstract_state(layout.nnx_init(port), sharding.make_mesh(devices))
    state, _, _ = store.read_nnx(directory, target, step)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {nnx_checkpoints.path_str(p): a for p, a in flat}


@pytest.mark.parametrize('name', ['mlp', 'score', 'cnn'])
def test_migration_is_lossless_legacy_to_nnx_and_back_bitwise(done_when, name, tmp_path):
    port, root = workloads.WORKLOADS[name], done_when[name][2]
    migration = migrate.migrate(str(root / 'legacy'), str(tmp_path / 'nnx'), port, step=10)
    legacy, nnx_ = _flat_legacy(port, str(root / 'legacy'), 10), _read_nnx(port, str(tmp_path / 'nnx'), 8)
    back = {p.legacy: np.asarray(nnx_[p.nnx]).astype(p.legacy_dtype) for p in migration.pairs}
    assert set(back) == set(legacy) and {p.nnx for p in migration.pairs} == set(nnx_)
    for path, value in legacy.items():
        assert back[path].dtype == value.dtype and back[path].tobytes() == value.tobytes(), path
    assert all(str(nnx_[p.nnx].dtype) == p.nnx_dtype for p in migration.pairs)


def test_migrate_command_prints_every_leaf_and_refuses_to_overwrite_without_force(done_when, tmp_path, capsys):
    legacy_dir, out = str(done_when['score'][2] / 'legacy'), str(tmp_path / 'nnx')
    # in-process (as a process, the command migrates in test_team_checkpoints and refuses in test_another_optimizer)
    assert checkpoint_command.main(['migrate', legacy_dir, out, '--workload', 'score']) == 0
    stdout = capsys.readouterr().out
    rows = stdout.splitlines()
    assert any(r.split()[:2] == ['params/embed_t/kernel', 'model/embed_t/kernel'] for r in rows), stdout
    assert any(r.split()[:2] == ['opt_state/1/0/mu/out/bias', 'optimizer/opt_state/1/0/mu/out/bias'] for r in rows)
    assert any(r.split()[:2] == ['step/step', 'optimizer/step'] and 'int32 -> uint32 (exact)' in r for r in rows)
    assert 'mapped 35 leaves (params 8, opt_state 18, ema 8, step 1)' in stdout
    assert 'could not map: nothing' in stdout and f'wrote {out} step 20' in stdout
    before = sorted(os.listdir(out))
    with pytest.raises(SystemExit) as refused:
        checkpoint_command.main(['migrate', legacy_dir, out, '--workload', 'score', '--step', '10'])
    assert refused.value.code == 2 and capsys.readouterr().err == f'error: {out} exists; pass --force to replace it\n'
    assert sorted(os.listdir(out)) == before == ['20']
    assert checkpoint_command.main(['migrate', legacy_dir, out, '--workload', 'score', '--step', '10', '--force']) == 0
    assert sorted(os.listdir(out)) == ['10']


# -- any placement: 2, 4 and 8 devices; NNX -> NNX bitwise -------------------------------------------


def resumed_at(port, config: RunConfig, step: int, root, nnx_devices: int | None = None, **options):
    """``run --resume-at step --checkpoint-dir root``: the harness's own run with its checkpoint hooks (legacy
    saves, ``migrate``, the new side restored onto ``nnx_devices`` devices and trained on)."""
    checkpoints = CheckpointOptions(resume_at=step, directory=str(root), **options)
    return resume.run(port, config, checkpoints, nnx_devices=nnx_devices)


@pytest.fixture(scope='module')
def mlp_global(tmp_path_factory):
    """Legacy mlp on 8 devices, global keys (the same numbers on any device count), saved at step 4 of 8,
    migrated, and NNX resumed from it on 8 devices: ``(config, its checkpoint folder, the result)``."""
    root = tmp_path_factory.mktemp('mlp_global')
    config = RunConfig(workload='mlp', devices=8, steps_per_call=2, calls=4, batch_size=64, rng_mode='global')
    return config, root, resumed_at(MLP, config, 4, root)


@pytest.mark.parametrize('devices', [2, 4, 8])
def test_migrated_checkpoint_restores_sharded_onto_2_4_8_devices_and_resumes_to_a_match(mlp_global, devices, tmp_path):
    require_devices(devices)
    config, root, on_8 = mlp_global
    restored = _read_nnx(MLP, str(root / 'nnx'), devices)
    mesh = sharding.make_mesh(devices)
    for path, leaf in restored.items():  # straight from disk onto the mesh: each device holds its copy
        assert leaf.sharding == sharding.replicated(mesh) and len(leaf.sharding.device_set) == devices, path
    result = on_8 if devices == 8 else resumed_at(MLP, config, 4, tmp_path, nnx_devices=devices)
    assert result.report.match, [(leaf.name, leaf.max_abs) for leaf in result.report.leaves if not leaf.ok]
    assert result.resumed_at == 4 and len(result.new.losses) == 4
    assert result.verdict.twin == Twins(DRAWS)  # the twin restored the same checkpoint: the floor is measured


def test_restore_train_state_in_your_own_code_on_both_sides(mlp_global):
    """The README's recipe: an NNX train state onto a 4-device mesh, a legacy one replicated on 2 devices."""
    require_devices(4)
    _, root, _ = mlp_global
    nnx_dir, legacy_dir = str(root / 'nnx'), str(root / 'legacy')
    mesh = sharding.make_mesh(4)
    make = lambda: train.TrainState(nnx_models.MLP(rngs=nnx.Rngs(0)), MLP.make_tx(1.0), None)  # noqa: E731
    train_state, rng, meta = nnx_checkpoints.restore_train_state(nnx_dir, make, mesh)
    assert int(train_state.optimizer.step[...]) == 4 and meta['step'] == 4 and rng.shape == (2,)
    assert train_state.model.hidden.kernel[...].sharding == sharding.replicated(mesh)
    make_state = layout.legacy_init(MLP)
    pstate, _, _ = legacy_checkpoints.restore_train_state(legacy_dir, make_state, jax.devices()[:2], step=4)
    assert pstate.params['hidden']['kernel'].shape[0] == 2 and int(pstate.step[0]) == 4
    np.testing.assert_array_equal(pstate.params['hidden']['kernel'][1], train_state.model.hidden.kernel[...])


def test_resuming_on_other_data_than_where_the_checkpoint_stopped_mismatches(mlp_global, tmp_path, monkeypatch):
    """Negative control: the comparison fails when the data stream does not continue at step 4."""
    config, _, _ = mlp_global
    given = harness.resumed_inputs

    def one_call_early(inputs, at, k):  # the calls after step 4 are 2, 3: given 1, 2
        return dataclasses.replace(given(inputs, at, k), calls=inputs.calls[at.step // k - 1 : -1])

    monkeypatch.setattr(harness, 'resumed_inputs', one_call_early)
    result = resumed_at(MLP, config, 4, tmp_path)
    assert result.resumed_at == 4 and not result.report.match


def test_a_resumed_run_is_held_to_the_floor_of_a_resumed_twin_which_fails_what_the_screen_passes(mlp_global, tmp_path):
    """Negative control for the twin on ``--resume-at``: NNX resumed with a learning rate 1.00001 times
    (``--perturb 1e-5``) passes the fixed screen; the floor of a twin restored from the same checkpoint
    fails it. The probes that start from the initial state do not run, and say so."""
    config, _, _ = mlp_global
    result = resumed_at(MLP, dataclasses.replace(config, perturb=1e-5), 4, tmp_path)  # NNX's optimizer only
    done = result.verdict.done
    assert not result.report.match and done[0] == Screen(passed=True) and result.verdict.twin == Twins(DRAWS)
    assert done[-1] == NotRun(Probe.GRADS, 'resumed from a checkpoint') and result.verdict.kind is Finding.UPDATE
    assert LegacyTwin(LegacyTwin.Ran.NOT_RUN, why='resumed from a checkpoint') in done


@pytest.fixture(scope='module')
def score_nnx(tmp_path_factory):
    """NNX score (keys drive its noise) trained 8 steps without stopping, saving every 2 calls."""
    config = RunConfig(workload='score', devices=8, steps_per_call=2, calls=4, batch_size=32)
    fed = made.make(SCORE, config)
    directory = str(tmp_path_factory.mktemp('score_nnx') / 'nnx')
    hook = resume.nnx_saver(directory, config, every=2)
    whole = sides.run_new(kinds.of(SCORE), config, fed, after_call=hook)
    return config, fed, whole, directory


def resumed_from(fed, restore):
    """What the new side is given when it resumes at step 4 (call 2) through ``restore``."""
    return dataclasses.replace(fed, calls=fed.calls[2:], rng=None, restore=restore, first_call=2)


def test_nnx_save_and_resume_is_bitwise_equal_to_an_uninterrupted_nnx_run(score_nnx):
    config, fed, whole, directory = score_nnx
    restore = resume.restorer(directory, config, 4)
    resumed = sides.run_new(kinds.of(SCORE), config, resumed_from(fed, restore))
    np.testing.assert_array_equal(resumed.losses, whole.losses[4:])
    for group, leaves in whole.final.items():
        for path, value in leaves.items():
            assert resumed.final[group][path].tobytes() == value.tobytes(), f'{group}/{path}'
    # The same checkpoint onto 2 devices: the same bits, on a 2-device mesh.
    require_devices(2)
    on_8, on_2 = _read_nnx(SCORE, directory, 8, 4), _read_nnx(SCORE, directory, 2, 4)
    assert all(np.asarray(on_2[p]).tobytes() == np.asarray(on_8[p]).tobytes() for p in on_8)
    assert all(len(leaf.sharding.device_set) == 2 for leaf in on_2.values())


def test_resuming_without_the_recorded_key_chain_is_not_the_same_run(score_nnx):
    """Negative control: the checkpoint's host key chain is what makes the keys continue."""
    config, fed, whole, directory = score_nnx
    fresh = lambda setup: (resume.restorer(directory, config, 4)(setup), jax.random.PRNGKey(0))[1]  # noqa: E731
    resumed = sides.run_new(kinds.of(SCORE), config, resumed_from(fed, fresh))
    assert not np.array_equal(resumed.losses, whole.losses[4:])


# -- user ports and what does not map -----------------------------------------------------------------


@pytest.fixture(scope='module')
def loop_port_checkpoint(tmp_path_factory):
    """The example loop port's own pmap TrainState (step, params, opt_state; AdamW), saved at steps 2 and 4,
    and NNX resumed at step 2 (the user's nnx.jit loop): ``(its legacy checkpoints, the result)``."""
    config = RunConfig(workload='mlp-port-loop', devices=2, steps_per_call=2, calls=2, batch_size=8, rng_mode='global')
    root = tmp_path_factory.mktemp('loop')
    return str(root / 'legacy'), resumed_at(my_port.LOOP, config, 2, root, every=1)


def test_a_user_loop_port_migrates_through_its_names_and_resumes(loop_port_checkpoint, tmp_path):
    directory, result = loop_port_checkpoint
    migration = migrate.migrate(directory, str(tmp_path / 'nnx'), my_port.LOOP, step=2)
    pairs = {p.legacy: p.nnx for p in migration.pairs}
    assert pairs['params/Dense_0/kernel'] == 'model/fc1/kernel'  # names={'Dense_0': 'fc1', ...}
    assert pairs['opt_state/0/nu/LayerNorm_0/scale'] == 'optimizer/opt_state/0/nu/norm/scale'
    assert len(pairs) == 20 and not migration.unmapped  # the dropout stream (nnx.RngState) is not a checkpoint leaf
    model, optimizer = my_port.LOOP.new_state(my_port.LOOP.nnx_model(nnx.Rngs(1)))
    state, _, _ = store.read_nnx(str(tmp_path / 'nnx'), nnx_checkpoints.state_dict(layout.View(model, optimizer)))
    nnx_checkpoints.load_into(layout.View(model, optimizer), state)  # into the user's own objects
    assert int(optimizer.step[...]) == 2
    assert result.resumed_at == 2 and result.report.match and len(result.new.losses) == 2


def test_another_optimizer_is_said_before_anything_is_written(loop_port_checkpoint, tmp_path):
    """An NNX port with another optimizer (SGD with momentum, not AdamW): no optimizer leaf can map. The
    pre-flight says so in one line naming both sides' slots (exit 2), and no NNX_DIR is made."""
    directory = loop_port_checkpoint[0]
    (tmp_path / 'sgd_port.py').write_text(
        'import dataclasses, my_port, optax\nfrom flax import nnx\n'
        'def state(model):\n    return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)\n'
        'PORT = dataclasses.replace(my_port.LOOP, new_state=state)\n'
    )
    out = tmp_path / 'nnx'
    env = {'PYTHONPATH': os.pathsep.join([EXAMPLE, str(tmp_path)])}
    proc = run_module('equivalence.checkpoint', 'migrate', directory, str(out), '--workload', 'sgd_port:PORT', env=env)
    assert proc.returncode == 2, proc.stderr
    assert_one_line_error(proc, 'an optimizer state of another optimizer')
    assert 'the pmap side holds 0/count, 0/mu, 0/nu, the new side 0/trace' in proc.stderr
    assert not out.exists()


# -- faults -----------------------------------------------------------------------------------------


def test_a_checkpoint_of_another_workload_or_shape_names_the_first_mismatching_leaf(done_when, tmp_path):
    mlp_root = done_when['mlp'][2]
    with pytest.raises(
        store.CheckpointError, match='first mismatching leaf params/embed_t/bias: not in the checkpoint'
    ):
        migrate.migrate(str(mlp_root / 'legacy'), str(tmp_path / 'a'), SCORE)
    wide = wider_mlp(40)
    expected = 'first mismatching leaf params/hidden/bias: checkpoint [30] float32, expected [40] float32'
    with pytest.raises(store.CheckpointError, match=expected.replace('[', r'\[')):
        migrate.migrate(str(mlp_root / 'legacy'), str(tmp_path / 'b'), wide)
    assert not (tmp_path / 'a').exists() and not (tmp_path / 'b').exists()
    expected = 'first mismatching leaf model/hidden/bias: checkpoint [30] float32, expected [40] float32'
    with pytest.raises(store.CheckpointError, match=expected.replace('[', r'\[')):  # the NNX side too
        _read_nnx(wide, str(mlp_root / 'nnx'), 8)


def _damaged_copy(source, tmp_path, damage: str) -> str:
    """A copy of a legacy checkpoint with one file truncated or overwritten with garbage."""
    copy = tmp_path / 'legacy'
    shutil.copytree(source, copy)
    state = copy / '20' / 'state'
    if damage == 'truncated':  # the largest array data file, cut in half
        data = max(
            (p for p in state.rglob('*') if p.is_file() and p.parent.name == 'd'), key=lambda p: p.stat().st_size
        )
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    else:  # the tree's metadata, overwritten
        (state / '_METADATA').write_bytes(b'\x00\xff' * 64)
    return str(copy)


@pytest.mark.parametrize('damage, expected', [('truncated', 'Error reading'), ('corrupted', 'cannot read checkpoint')])
def test_a_damaged_file_exits_2_with_one_line(done_when, tmp_path, damage, expected, capsys):
    """Through the command's own main, in-process (its exit 2 and one line as a process: the other optimizer
    above, and the migrate command's run)."""
    legacy_dir = _damaged_copy(done_when['mlp'][2] / 'legacy', tmp_path, damage)
    with pytest.raises(SystemExit) as exit_:
        checkpoint_command.main(['migrate', legacy_dir, str(tmp_path / 'nnx'), '--step', '20'])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = message_lines(err)  # one line: no traceback
    assert len(lines) == 1 and lines[0].startswith('error: ') and legacy_dir in lines[0], err  # or a file in it
    assert expected in err and not (tmp_path / 'nnx').exists()


WRITER = """
import sys, time
import jax
from orbax.checkpoint._src.path import atomicity
from equivalence.checkpoint import layout
from equivalence.core.port import workloads
from legacy_pmap import checkpoints, train

pstate = train.replicate(layout.legacy_init(workloads.WORKLOADS['mlp'])(), jax.devices()[:1])
manager = checkpoints.make_manager(sys.argv[1])
checkpoints.save(manager, 5, pstate, jax.random.PRNGKey(0))


async def stalled(self):  # step 10's files are written; the rename that would commit them never happens
    print('writing step 10', flush=True)
    time.sleep(600)


atomicity.AtomicRenameTemporaryPath.finalize = stalled
checkpoints.save(manager, 10, pstate, jax.random.PRNGKey(1))
"""


def test_a_writer_killed_halfway_leaves_nothing_that_reads_as_a_checkpoint(tmp_path):
    directory = tmp_path / 'legacy'
    writer = subprocess.Popen(
        [sys.executable, '-c', WRITER, str(directory)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert writer.stdout.readline().decode().strip() == 'writing step 10'
    finally:
        writer.kill()  # SIGKILL: no handler runs, no cleanup
        writer.wait()
    partial = [p for p in directory.iterdir() if p.name.startswith('10.')]
    assert len(partial) == 1 and list(partial[0].rglob('ocdbt.process_0/d/*'))  # array files written, uncommitted
    assert migrate.migrate(str(directory), str(tmp_path / 'nnx'), MLP).step == 5  # the latest complete step
    with pytest.raises(store.CheckpointError, match=r'no complete checkpoint of step 10 .* \(complete steps: 5\)'):
        migrate.migrate(str(directory), str(tmp_path / 'nnx10'), MLP, step=10)
    # Negative control: the same files under the final name, as a writer without the atomic rename leaves them,
    # are taken for the latest checkpoint.
    partial[0].rename(directory / '10')
    assert legacy_checkpoints.open_step(str(directory))[1] == 10


# -- flags ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    'args, expected',
    [
        (['--resume-at', '7'], '--resume-at 7 must be a positive multiple of --steps-per-call 5 below the 20 steps'),
        (['--resume-at', '0'], '(one of 5, 10, 15)'),
        (['--resume-at', '20'], '--resume-at 20 must be a positive multiple'),
        (['--resume-at', '10', '--checkpoint-every', '3'], 'is not a step the legacy run saves at'),
        (['--checkpoint-every', '2'], '--checkpoint-every needs --checkpoint-dir or --resume-at'),
        (['--resume-at', '10', '--keep-checkpoints', '0'], '--keep-checkpoints must be at least 1'),
    ],
)
def test_bad_checkpoint_flags_exit_2_with_one_line(args, expected, capsys):
    with pytest.raises(SystemExit) as e:
        run_command.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1 and err.startswith('error: ') and expected in err, err


def test_a_checkpoint_dir_that_already_holds_checkpoints_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / 'legacy' / '10').mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        run_command.main(['--resume-at', '10', '--checkpoint-dir', str(tmp_path)])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and err == f'error: --checkpoint-dir {tmp_path}: {tmp_path}/legacy is not empty; choose a new directory\n'
    )
