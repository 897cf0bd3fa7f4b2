"""Checkpoints never lose data: migrate never writes where it reads, never drops a legacy field
silently, and a flipped byte is caught by ``verify`` and by ``--resume-at``'s restore.
Each checkpoint here is written directly (no training): these are checks of the files."""

import contextlib
import dataclasses
import hashlib
import io
import os
import shutil

import flax
import jax
import jax.numpy as jnp
import pytest
from hostile_ports import LOOP, old

from equivalence.checkpoint import __main__ as checkpoint_command
from equivalence.checkpoint import manifest, resume, store
from equivalence.checkpoint.store import CheckpointError
from equivalence.core import kinds
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.port.ports import LoopPort
from equivalence.core.run import inputs as made
from equivalence.core.run.inputs import make_inputs
from legacy_pmap import checkpoints as legacy_checkpoints
from legacy_pmap import train as legacy


@flax.struct.dataclass
class ScaledState:
    """A pmap-era train state with fields outside params and opt_state, as flax's ImageNet example has."""

    step: jax.Array
    params: dict
    opt_state: tuple
    dynamic_scale: dict  # flax's DynamicScale for mixed precision: no NNX place
    counter: jax.Array  # a custom counter


def scaled_state(variables: dict) -> ScaledState:
    base = old.create_state(variables)
    scale = {'scale': jnp.float32(2.0**15), 'fin_steps': jnp.int32(3)}
    return ScaledState(base.step, base.params, base.opt_state, scale, jnp.int32(7))


SCALED = dataclasses.replace(LOOP, legacy_state=scaled_state)
MLP = workloads.WORKLOADS['mlp']


def save_legacy(port, directory: str, step: int = 4) -> None:
    """The port's legacy train state, as its pmap loop would save it at ``step`` (nothing trained)."""
    config = RunConfig(workload=port.name, devices=1, steps_per_call=1, calls=1, batch_size=1, rng_mode='global')
    variables, _, rng = make_inputs(port, config)
    if isinstance(port, LoopPort):
        state = port.legacy_state(variables)
    else:
        state = legacy.create_state(variables, port.make_tx(1.0), port.ema_rate)
    pstate = legacy.replicate(state, jax.local_devices()[:1])
    manager = legacy_checkpoints.make_manager(directory)
    with store.quiet():
        legacy_checkpoints.save(manager, step, pstate, rng, {'seed': 0, 'workload': port.name})  # as resume.record
    manager.close()


def tree_digest(root: str) -> str:
    h = hashlib.sha256()
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            h.update(os.path.relpath(os.path.join(folder, name), root).encode())
            h.update(open(os.path.join(folder, name), 'rb').read())
    return h.hexdigest()


def command(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = checkpoint_command.main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    """A legacy checkpoint of the example loop port, another with dynamic_scale and a counter, and
    the first one migrated (with its manifest)."""
    root = tmp_path_factory.mktemp('safety')
    save_legacy(LOOP, str(root / 'legacy'))
    save_legacy(SCALED, str(root / 'scaled'))
    save_legacy(MLP, str(root / 'mlp'))  # arrays above OCDBT's inline size: stored outside its CRC-checked nodes
    assert command('migrate', str(root / 'mlp'), str(root / 'mlp-nnx'), '--workload', 'mlp')[0] == 0
    assert command('migrate', str(root / 'legacy'), str(root / 'nnx'), '--workload', 'hostile_ports:LOOP')[0] == 0
    return root


@pytest.mark.parametrize('target', ['.', 'sub', 'sub/deeper', '..'])
def test_migrate_never_writes_where_it_reads_force_or_not(checkpoints, target):
    source = checkpoints / 'legacy'
    before = tree_digest(str(checkpoints))
    for force in ([], ['--force']):
        nnx_dir = os.path.normpath(os.path.join(source, target))
        code, _, err = command('migrate', str(source), nnx_dir, '--workload', 'hostile_ports:LOOP', *force)
        assert code == 2 and err.count('\n') == 1 and 'migrate never writes where it reads' in err, err
    assert tree_digest(str(checkpoints)) == before  # every byte of the source kept
    assert sorted(os.listdir(source)) == ['4']


def test_a_field_without_an_nnx_place_is_exit_2_listing_it_unless_the_port_skips_it(checkpoints, tmp_path):
    code, out, err = command('migrate', str(checkpoints / 'scaled'), str(tmp_path / 'a'), '--workload',
                             'test_checkpoint_safety:SCALED')  # fmt: skip
    assert code == 2 and err.startswith('error: 3 leaves of') and 'nothing written' in err, err
    assert 'legacy counter [] int32: no group reads it' in out and 'legacy dynamic_scale/scale [] float32' in out
    assert not (tmp_path / 'a').exists()
    code, out, err = command('migrate', str(checkpoints / 'scaled'), str(tmp_path / 'b'), '--workload',
                             'test_checkpoint_safety:SCALED_SKIPPING')  # fmt: skip
    assert code == 0, err
    skipped = out.split("skipped, as the port's skip= says: ")[1].splitlines()[0].split('; ')
    assert sorted(skipped) == ['legacy counter [] int32', 'legacy dynamic_scale/fin_steps [] int32',
                               'legacy dynamic_scale/scale [] float32']  # fmt: skip


def test_migrate_refuses_an_nnx_checkpoint_names_the_recorded_workload_and_a_moved_pair_verifies(checkpoints, tmp_path):
    """An NNX checkpoint given as LEGACY_DIR is said to be one (not 'first mismatching leaf step: not in
    the checkpoint'); a legacy one with the wrong --workload names the workload its meta records; the
    manifest holds the legacy source relative to the NNX checkpoint, so the pair verifies once moved."""
    code, _, err = command('migrate', str(checkpoints / 'mlp-nnx'), str(tmp_path / 'twice'), '--workload', 'mlp')
    assert code == 2 and err.count('\n') == 1 and 'step 4 is already an NNX checkpoint' in err, err
    assert 'migrated from' in err and 'nothing to migrate' in err and not (tmp_path / 'twice').exists()
    code, _, err = command('migrate', str(checkpoints / 'mlp'), str(tmp_path / 'other'), '--workload', 'score')
    assert code == 2 and 'first mismatching leaf' in err, err
    assert "its meta records workload 'mlp', not 'score': pass --workload mlp" in err, err
    moved = tmp_path / 'moved'
    for name in ('mlp', 'mlp-nnx'):
        shutil.copytree(checkpoints / name, moved / name)
    record = manifest.read(str(moved / 'mlp-nnx'), 4)
    assert record['legacy_dir'] == os.path.join('..', 'mlp') and record['legacy_dir_absolute'] == str(
        checkpoints / 'mlp'
    )
    code, out, err = command('verify', str(moved / 'mlp-nnx'))  # the legacy source found through the manifest
    assert code == 0 and f'{moved / "mlp"} step 4: ' in out and out.count('leaves match their sha256') == 2, out + err


SCALED_SKIPPING = dataclasses.replace(SCALED, skip=('dynamic_scale', 'counter'))


def flip_until_silent(nnx_dir) -> str:
    """Flip one bit of the arrays' (compressed) bytes at successive offsets until Orbax reads the
    checkpoint without an error but with another value: the silent case only the manifest catches.
    Offsets where Orbax itself fails (DATA_LOSS) are put back. Returns the leaf the manifest names
    (its leaves alone: the files' sha256 would name the file first)."""
    files = list((nnx_dir / '4' / 'state').glob('**/d/*'))  # OCDBT's per-process files and the merged copy
    size = max(f.stat().st_size for f in files)
    for offset in range(size // 2, size, 97)[:10]:
        originals = {f: f.read_bytes() for f in files if f.stat().st_size == size}
        for f, raw in originals.items():
            f.write_bytes(raw[:offset] + bytes([raw[offset] ^ 0x01]) + raw[offset + 1 :])
        try:
            with store.quiet():
                manifest.verify(str(nnx_dir), step=4, files=False)
        except CheckpointError as e:
            if 'does not match its manifest' in str(e):
                return str(e).split(' leaf ')[1].split()[0]
        for f, raw in originals.items():
            f.write_bytes(raw)
    raise AssertionError('no flipped bit read back silently')


def test_a_flipped_byte_is_caught_by_verify_and_by_the_resume_restore(checkpoints, tmp_path):
    code, out, err = command('verify', str(checkpoints / 'nnx'), str(checkpoints / 'legacy'))
    assert code == 0 and out.count('20 leaves match their sha256') == 2, out + err
    damaged = tmp_path / 'nnx'
    shutil.copytree(checkpoints / 'mlp-nnx', damaged)
    flip_until_silent(damaged)  # the leaf the flip changed is named by the leaves' sha256 alone
    code, _, err = command('verify', str(damaged))  # and first by the sha256 of the file that holds it
    assert code == 2 and err.count('\n') == 1 and 'step 4: file state/' in err and 'does not match its' in err, err
    config = RunConfig(workload='mlp', devices=1, steps_per_call=1, calls=1, batch_size=1, rng_mode='global')
    setup = kinds.of(MLP).new_setup(config, made.make(MLP, config))
    with pytest.raises(CheckpointError, match='file state/.* does not match its manifest'):
        resume.restorer(str(damaged), config, 4)(setup)  # --resume-at's restore, before anything is loaded
    resume.restorer(str(checkpoints / 'mlp-nnx'), config, 4)(setup)  # the intact one restores


def test_verify_hashes_every_file_so_a_byte_no_leaf_reads_is_caught_naming_the_file(checkpoints, tmp_path):
    """One byte flipped at offset 1000 of a per-process OCDBT data file: no leaf's hash need see it
    (the leaves are read through the merged tree), so verify also holds every file of the step to the
    sha256 migrate recorded, and names the file."""
    damaged = tmp_path / 'nnx'
    shutil.copytree(checkpoints / 'mlp-nnx', damaged)
    record = manifest.read(str(damaged), 4)
    on_disk = {str(p.relative_to(damaged / '4')) for p in (damaged / '4').rglob('*') if p.is_file()}
    assert set(record['files']) == on_disk - {manifest.NAME}  # every file of the step but the manifest
    data = max((damaged / '4' / 'state' / 'ocdbt.process_0' / 'd').iterdir(), key=lambda p: p.stat().st_size)
    raw = data.read_bytes()
    assert len(raw) > 1000
    data.write_bytes(raw[:1000] + bytes([raw[1000] ^ 0xFF]) + raw[1001:])
    code, _, err = command('verify', str(damaged))
    name = str(data.relative_to(damaged / '4'))
    assert code == 2 and err.count('\n') == 1 and f'step 4: file {name} does not match its manifest' in err, err


def test_every_checkpoint_subcommand_answers_in_one_line(checkpoints, monkeypatch, tmp_path):
    assert command('verify', str(tmp_path / 'missing'))[0] == 2
    code, _, err = command('verify', str(checkpoints / 'legacy'))  # a legacy checkpoint has no manifest
    assert code == 2 and 'has no equivalence-manifest.json' in err, err
    monkeypatch.setenv('EQUIVALENCE_INJECT_INTERNAL_ERROR', '1')
    code, out, err = command('verify', str(checkpoints / 'nnx'))
    assert code == 3 and err.count('\n') == 1 and not out, (out, err)  # one line: no traceback
