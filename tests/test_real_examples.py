"""The examples written as real code was in the wild, run from a fresh directory as a team runs
them: their steps, passed as written, match, and each one's slip is caught. ``score_sde_port``
(score_sde's ``pmap(partial(lax.scan, step))`` with per-device keys, against ``nnx.jit(nnx.scan)`` over
model, optimizer and EMA) and ``bridge_port`` (a linen model wrapped by ``nnx.bridge.ToNNX``, trained in
NNX): their MATCH at 2 devices and their slip. ``wmt_port`` and ``imagenet_port`` (linen pmap -> NNX
objects): their slip at 8 devices; their MATCH is ``test_team_checkpoints``' (each port's own
checkpoint migrated, resumed to a MATCH at 2 devices). Their own ``test_port.py`` runs D in {1, 2, 4, 8}
(minutes on 2 cores); here one device count, to keep the suite's time.

Not trained here, each passes its pre-flight in-process (traced abstractly, nothing compiled), so that
none rots unseen: ``vit_port`` (a Vision Transformer, its momentum in bfloat16, judged in its own
precision: the precision rule's MATCH and slip are ``test_corpus``' bfloat16 pair, the rule on numbers
``test_precision``'s); ``functional_nnx_port`` (functional NNX in a flax ``TrainState``: the same form,
its MATCH and the same Adam b2 slip, are ``test_new_sides``' ``functional-nnx``); ``linen_jit_port``
(linen under ``jax.jit``, its mesh built at import: ``test_new_sides``' ``linen-jit`` and ``test_twins``'
``jax.jit`` pinned to a mesh built at import, its floor from a twin in a fresh process, MATCH and slip);
``gpt2_port`` (a GPT-2 language model's pmap step against its NNX port: its MATCH at D = 1, 2, 4, 8 and its two
slips, each a check of 1 to 2 minutes here, are its own ``test_port.py``'s). The examples' real sizes
(``docs/examples.md``, real sizes) are not traced here: about 20 s each."""

import os
import shutil

import jax
import pytest
from conftest import ROOT, at_level_0, import_example, run_pytest_in

from equivalence.core import kinds, preflight
from equivalence.core.port.config import RunConfig

SELECTED = {  # example -> the tests of its test_port.py run here; the longest first (conftest.LONGEST_FIRST)
    'score_sde_port': 'D2 or slip',
    'bridge_port': 'D2 or slip',  # its key-array variant (LOOP_RAW_KEY): its own test_port.py
    'wmt_port': 'slip',  # its MATCH: test_team_checkpoints
    'imagenet_port': 'slip',  # its MATCH: test_team_checkpoints
}


@pytest.mark.parametrize('name', list(SELECTED))
def test_example_from_a_fresh_directory_matches_and_catches_its_slip(name, tmp_path):
    folder = os.path.join(ROOT, 'examples', name)
    for file in os.listdir(folder):
        if file.endswith('.py'):
            shutil.copy(os.path.join(folder, file), tmp_path)
    # the suite on PYTHONPATH, as an installed package would be (not the example's folder)
    # at XLA's level 0 (conftest.at_level_0): these real models' sides still differ in their last bits
    proc = run_pytest_in(tmp_path, '-k', SELECTED[name], env=at_level_0({'PYTHONPATH': ROOT}), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f'{len(SELECTED[name].split(" or "))} passed' in proc.stdout, proc.stdout[-2000:]


NOT_TRAINED_HERE = [('vit_port', 'LOOP'), ('functional_nnx_port', 'PORT'), ('linen_jit_port', 'PORT'),
                    ('linen_jit_port', 'PORT_WARMUP_SLIP'), ('gpt2_port', 'LOOP')]  # fmt: skip


@pytest.mark.parametrize('name, field', NOT_TRAINED_HERE)
def test_an_example_not_trained_here_passes_its_pre_flight(name, field):
    port = getattr(import_example(name, 'my_port')[0], field)  # another example's my_port put back after
    devices = len(jax.devices())  # linen_jit_port's mesh: every device JAX sees when it is imported
    config = RunConfig(workload=port.name, devices=devices, steps_per_call=2, calls=2,
                       batch_size=port.default_batch, rng_mode=port.rng_modes[0], available=devices)  # fmt: skip
    assert isinstance(preflight.check(kinds.of(port), config), dict)  # a mistake raises: exit 2 in the command
