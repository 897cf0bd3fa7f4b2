"""The teams' own checkpoints: the image classifier's flax ``save_checkpoint`` directory and the
Transformer's Orbax ``CheckpointManager`` migrate through the port's names and resume to MATCH;
the same refusals as the suite's own layout."""

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable

import jax
import pytest
from conftest import ROOT, import_example, require_devices, run_module

from equivalence.checkpoint import migrate, resume
from equivalence.checkpoint.options import CheckpointOptions
from equivalence.checkpoint.store import CheckpointError
from equivalence.core import harness
from equivalence.core.port.config import RunConfig
from equivalence.core.run import adapters

# Compiled at XLA's level 0 in this worker (conftest.at_level_0_in_process), as the subject allows:
AT_LEVEL_0 = (
    'checkpoints migrated and resumed; these real models keep their differences between the sides at level 0 '
    '(conftest.at_level_0)'
)


def example(name: str):
    """The example's ``legacy_code`` and ``my_port``, imported as the team's own modules (``import_example``: the
    modules of those names imported before, the mlp example's in the same worker, are put back)."""
    return import_example(name, 'legacy_code', 'my_port')


def team_saver(name: str, old, directory: str):
    """A harness ``after_call`` hook that saves after every call with the team's own code."""
    if name == 'imagenet_port':  # flax.training.checkpoints.save_checkpoint: <dir>/checkpoint_<step>/
        return lambda setup, calls_done, rng: old.save_checkpoint(setup.pstate, directory)
    manager = old.make_checkpoint_manager(directory)  # orbax CheckpointManager: <dir>/<step>/default/
    return lambda setup, calls_done, rng: old.save_checkpoint(manager, setup.pstate)


@dataclasses.dataclass(frozen=True)
class TeamCheckpoints(resume.Checkpoints):
    """``run --resume-at``'s own hooks (``resume.Checkpoints``), but the legacy side saves with the team's code
    (``save``: a folder -> the hook) into ``<root>/team``, the folder the session migrates and resumes from."""

    save: Callable | None = None

    @contextlib.contextmanager
    def session(self, prepared):
        with super().session(prepared) as session:
            session.directory = os.path.join(session.root, 'team')
            session.after_legacy_call = self.save(session.directory)
            yield session


def resumed(name: str, tmp_path):
    """``(migration, result, port, team dir, resume again)`` of the example's LOOP, saved after every call by
    the team's code, migrated and resumed at step 2: the harness's own run (``harness.run``, its checkpoint
    hooks). ``resume again``: the same run afresh, in a folder of its own."""
    old, my_port = example(name)
    port = my_port.LOOP
    config = RunConfig(workload=port.name, devices=2, steps_per_call=2, calls=2, batch_size=8,
                       rng_mode=port.rng_modes[0])  # fmt: skip
    save = lambda directory: team_saver(name, old, directory)  # noqa: E731

    def again(root: str):
        checkpoints = TeamCheckpoints(CheckpointOptions(resume_at=2, directory=root), save=save)
        return harness.run(port, config, checkpoints=checkpoints)

    result, team_dir = again(str(tmp_path)), str(tmp_path / 'team')
    migration = migrate.migrate(team_dir, str(tmp_path / 'migrated'), port, step=2)  # what the run's own mapped
    return migration, result, port, team_dir, lambda: again(tempfile.mkdtemp(dir=tmp_path))


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """Each example trained, saved by its own code, migrated and resumed: once for the module."""
    require_devices(2)
    return {name: resumed(name, tmp_path_factory.mktemp(name)) for name in ('imagenet_port', 'wmt_port')}


@pytest.mark.parametrize('name', ['imagenet_port', 'wmt_port'])
def test_a_teams_own_checkpoint_migrates_and_resumes_to_match(runs, name, tmp_path):
    migration, result, port, team_dir, _ = runs[name]
    assert migration.written and migration.step == 2 and not migration.unmapped
    assert result.report.match, [leaf for leaf in result.report.leaves if not leaf.ok]
    assert result.resumed_at == 2 and len(result.new.losses) == 2
    if name == 'imagenet_port':  # the TrainState's batch_stats are read; another port's state is refused
        assert any(p.legacy.startswith('model_state/batch_stats/') for p in migration.pairs)
        with pytest.raises(CheckpointError, match=r'does not fit the port.s train state: first mismatching leaf'):
            migrate.migrate(team_dir, str(tmp_path / 'other'), runs['wmt_port'][2], step=2)
        with pytest.raises(CheckpointError, match=r'no complete checkpoint of step 3 .*flax save_checkpoint'):
            migrate.migrate(team_dir, str(tmp_path / 'other'), port, step=3)


def test_without_the_recomputed_key_chain_the_resumed_transformer_does_not_match(runs, monkeypatch):
    """Negative control: a team's checkpoint holds no host key chain; the suite recomputes it from
    the seed. With the placeholder key instead, the resumed dropout masks differ."""
    monkeypatch.setattr(adapters, 'chain_at', lambda draws, config, rng, calls: jax.random.PRNGKey(0))
    assert not runs['wmt_port'][4]().report.match


def test_migrate_from_the_command_line_reads_a_flax_directory(runs, tmp_path):
    """The command on a team's flax directory (its refusal of a step it does not hold: in-process above, with
    the format's words; a refusal as exit 2 and one line from the command: test_checkpoint's damaged files)."""
    team_dir = runs['imagenet_port'][3]
    env = {'PYTHONPATH': f'{os.path.join(ROOT, "examples", "imagenet_port")}:{ROOT}'}
    ok = run_module('equivalence.checkpoint', 'migrate', team_dir, str(tmp_path / 'cli'), '--workload',
                    'my_port:LOOP', env=env)  # fmt: skip
    assert ok.returncode == 0 and 'step 4' in ok.stdout and 'model_state/batch_stats' in ok.stdout, ok.stderr
