"""A team's own port, at both levels: names paired before training, dropout inside the model,
the example in ``examples/mlp_port`` from a fresh directory, and the slips it must catch."""

import dataclasses
import os
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, assert_one_line_error, at_level_0, require_devices, run_module
from flax import nnx

from equivalence.core import harness
from equivalence.core.compare.outcome import Outcome
from equivalence.core.port import naming, workloads
from equivalence.core.port.naming import PortError
from equivalence.core.rng import randomness
from equivalence.devices import without_device_count

EXAMPLE = os.path.join(ROOT, 'examples', 'mlp_port')
sys.path.insert(0, EXAMPLE)
import my_port  # noqa: E402  (the example, imported as a user's module)

QUICK = {'steps_per_call': 2, 'calls': 2}


def _bad(result) -> list[str]:
    return [leaf.name for leaf in result.report.leaves if not leaf.ok]


# -- names --------------------------------------------------------------------------------------


def _specs(linen_model, nnx_model):
    variables = linen_model.init(jax.random.PRNGKey(0), jnp.ones((1, 8)), False)
    return naming.linen_spec(variables), naming.nnx_spec(nnx.eval_shape(lambda: nnx_model(nnx.Rngs(0))))


def test_names_pair_by_prefixes_by_function_and_by_unique_structure():
    linen, nnx_ = _specs(my_port.old.MLP(), lambda rngs: my_port.new.MLP(rngs=rngs))
    expected = {f'{a}/{leaf}': f'{b}/{leaf}' for a, b, leaves in [
        ('Dense_0', 'fc1', ('kernel', 'bias')), ('LayerNorm_0', 'norm', ('scale', 'bias')),
        ('Dense_1', 'fc2', ('kernel', 'bias')),
    ] for leaf in leaves}  # fmt: skip
    prefixes = {'Dense_0': 'fc1', 'LayerNorm_0': 'norm', 'Dense_1': 'fc2'}
    assert naming.resolve(linen, nnx_, prefixes) == expected
    assert naming.resolve(linen, nnx_, lambda p: expected[p]) == expected
    assert naming.resolve(linen, nnx_, naming.STRUCTURE) == expected
    # The optimizer state mirrors the parameters: its paths are renamed where they end in one.
    assert naming.rename_path('0/mu/Dense_0/kernel', expected) == '0/mu/fc1/kernel'


def test_structure_refuses_two_submodules_that_hold_the_same_shapes():
    linen = {f'Dense_{i}/{leaf}': ('params', shape, 'float32') for i in (0, 1) for leaf, shape in
             (('kernel', (4, 4)), ('bias', (4,)))}  # fmt: skip
    nnx_ = {f'{m}/{leaf}': v for m in ('first', 'second') for leaf, v in
            (('kernel', linen['Dense_0/kernel']), ('bias', linen['Dense_0/bias']))}  # fmt: skip
    with pytest.raises(PortError, match=r"ambiguous: linen \['Dense_0', 'Dense_1'\] and NNX \['first', 'second'\]"):
        naming.resolve(linen, nnx_, naming.STRUCTURE)
    # A dict settles it, and a wrong dict (a swapped pair with other shapes) is named, not guessed.
    assert naming.resolve(linen, nnx_, {'Dense_0': 'first', 'Dense_1': 'second'})['Dense_1/bias'] == 'second/bias'


def test_unpaired_names_stop_the_run_before_any_training(monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError('trained before the names were checked')

    monkeypatch.setattr(harness, 'run_legacy', no_training)
    port = dataclasses.replace(my_port.MODEL, names={'Dense_0': 'fc1'})
    with pytest.raises(PortError) as e:
        harness.check(port, devices=2, **QUICK)
    message = str(e.value)
    assert '\n' not in message
    assert 'linen LayerNorm_0/scale [32] float32, closest NNX: norm/scale [32]' in message
    assert 'NNX fc2/kernel [32, 1] float32, closest linen: Dense_1/kernel [32, 1]' in message
    assert 'Dense_0' not in message  # the pairs the dict did make are not reported


# -- the example, both levels ---------------------------------------------------------------------


def test_from_a_fresh_directory_the_loop_matches(tmp_path):
    """The command line on a port of the folder it runs in. The example's own tests from a fresh folder
    (the README's blocks over this example, across 2 processes too) run in ``test_docs``; a slip of this
    port through the command exits 1 in ``test_cli`` (``--perturb``), and is named in-process below and
    in ``test_verdict`` (the gelu slip's first-step gradients; the loop's LayerNorm epsilon slip, its
    losses and parameters). Its names left out (``names=None``) are the one line below, in-process."""
    for name in ('legacy_code.py', 'nnx_code.py', 'my_port.py'):
        shutil.copy(os.path.join(EXAMPLE, name), tmp_path)
    environ = {k: v for k, v in without_device_count(at_level_0(dict(os.environ))).items() if k != 'PYTHONPATH'}
    args = ['--workload', 'my_port:LOOP', '--steps-per-call', '2', '--calls', '2']
    cmd = [sys.executable, '-m', 'equivalence.run', *args]
    loop = subprocess.run(cmd, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)
    # level 2 from the command line: --rng defaults to the port's global
    assert loop.returncode == 0 and 'rng global' in loop.stdout, loop.stderr  # exit 0: MATCH


def test_a_workload_named_by_its_path_its_file_or_a_standard_module_name_says_what_to_name(tmp_path, monkeypatch):
    """``./conv_port:MODEL`` (importlib: 'the package argument is required'), ``conv_port.py:MODEL``, and
    a port file called ``random.py``, which Python's own ``random`` shadows (it is imported already)
    or which shadows it (imported first, breaking every library that imports ``random``)."""
    from equivalence.core.port import loading
    from equivalence.core.port.config import ConfigError

    for name in ('conv_port', 'random'):
        (tmp_path / f'{name}.py').write_text('MODEL = None\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = {
        './conv_port:MODEL': 'names a path: name the module, --workload conv_port:MODEL, and run from its folder',
        'ports/v2/conv_port.py:MODEL': 'names a path: name the module, --workload conv_port:MODEL, and run from its '
        'folder (ports/v2) or put that folder on PYTHONPATH',
        'conv_port.py:MODEL': 'names the file: drop .py, --workload conv_port:MODEL',
        'random:MODEL': f"{tmp_path / 'random.py'} is shadowed by the standard library's random",
    }
    for spec, line in expected.items():
        with pytest.raises(ConfigError) as e:
            loading.load(spec)
        assert str(e.value).startswith(f'--workload {spec!r} ') and line in str(e.value), e.value
    assert 'rename the file, e.g. random_port.py, and pass --workload random_port:MODEL' in str(e.value)
    # As a command the file comes first on the path: it shadows random, before the suite can start.
    proc = run_module('equivalence.run', '--workload', 'random:MODEL', env={'PYTHONPATH': str(tmp_path)})
    assert_one_line_error(proc, f"{tmp_path / 'random.py'} shadows the standard library's random")


def test_a_module_that_does_not_import_says_why_it_can_be_told(tmp_path, monkeypatch):
    """A stub of a heavy package that lacks a submodule the code imports (trials: a tensorflow stub without
    tensorflow.io, which flax imported in the twin's fresh process) said 'is its folder on PYTHONPATH?'
    while it was. The stub is named; a dependency not installed is asked about; the port's own module
    missing keeps the path question."""
    from equivalence.core.port import loading
    from equivalence.core.port.config import ConfigError

    (tmp_path / 'fakeheavy').mkdir()
    (tmp_path / 'fakeheavy' / '__init__.py').write_text('')
    (tmp_path / 'stubbed_port.py').write_text('import fakeheavy.io\nPORT = None\n')
    (tmp_path / 'needs_port.py').write_text('import not_installed_anywhere\nPORT = None\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = {
        'stubbed_port:PORT': "'fakeheavy' imported (",
        'needs_port:PORT': 'imported by needs_port: is it installed, or its folder on PYTHONPATH?',
        'absent_port:PORT': "cannot import 'absent_port' (is its folder on PYTHONPATH?)",
    }
    for spec, said in expected.items():
        with pytest.raises(ConfigError) as e:
            loading.load(spec)
        assert said in str(e.value), e.value
    with pytest.raises(ConfigError, match=r"has no 'fakeheavy\.io'; a stub must hold every submodule"):
        loading.load('stubbed_port:PORT')


def test_a_mistake_in_another_port_of_the_module_names_that_port_and_its_line(tmp_path, monkeypatch):
    """Importing the module builds every port in it: a wrong field in PORT_B, while PORT_A is asked for,
    is said to be PORT_B's, at the line of the user's module that built it, not PORT_A's."""
    from equivalence.core.port import loading
    from equivalence.core.port.config import ConfigError

    (tmp_path / 'two_ports.py').write_text(
        'import dataclasses\nimport my_port\n\nPORT_A = my_port.MODEL\n'
        "PORT_B = dataclasses.replace(\n    my_port.MODEL,\n    rng_modes='global',\n)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    field = "port 'mlp-port': rng_modes is the string 'global', not a tuple: use rng_modes=('global',)"
    with pytest.raises(ConfigError) as e:
        loading.load('two_ports:PORT_A')
    assert str(e.value).startswith("--workload 'two_ports:PORT_A': importing two_ports failed building PORT_B ")
    assert '(two_ports.py:5), not PORT_A, the port asked for: ' + field in str(e.value), e.value
    with pytest.raises(ConfigError) as e:
        loading.load('two_ports:PORT_B')
    assert str(e.value) == f"--workload 'two_ports:PORT_B': PORT_B (two_ports.py:5): {field}"


def test_assert_port_matches_fails_with_an_assertion_error_that_pytest_raises_catches():
    """A slip is an ``AssertionError`` (``PortMismatch``, holding the report), as numpy.testing and chex
    fail, so ``pytest.raises(AssertionError)`` around it passes; a mistake in the port too, shown as
    its one ``error:`` line (``pytrace=False``, as ``pytest.fail`` showed it)."""
    from equivalence.testing import PortInputError, PortMismatch, assert_port_matches

    with pytest.raises(AssertionError) as slip:
        assert_port_matches(my_port.MODEL_GELU_SLIP, devices=2, steps_per_call=1, calls=1, diagnose=False)
    assert isinstance(slip.value, PortMismatch) and not slip.value.result.report.match
    assert slip.value.result.outcome is Outcome.MISMATCH and str(slip.value) == slip.value.report
    unnamed = dataclasses.replace(my_port.MODEL, names=None)
    with pytest.raises(AssertionError, match=r'^error: port .*closest NNX: fc1/kernel') as bad:
        assert_port_matches(unnamed, devices=2, steps_per_call=1, calls=1)
    assert isinstance(bad.value, PortInputError) and '\n' not in str(bad.value) and bad.value.pytrace is False
    assert 'linen Dense_0/kernel [8, 32] float32, closest NNX: fc1/kernel [8, 32]' in str(bad.value), bad.value


def test_init_args_is_given_a_batch_of_one_example_as_the_port_guide_says():
    """``init_args`` and ``init_kwargs`` get one example with its batch axis kept, every leaf ``[1, ...]``
    (``v[0, :1]`` of the first step of ``make_data``), and docs/port.md says so in those words."""
    from equivalence.core.port.config import RunConfig
    from equivalence.core.run.inputs import make_inputs

    seen = []
    port = dataclasses.replace(my_port.MODEL, init_args=lambda b: seen.append(b) or my_port.MODEL.init_args(b))
    make_inputs(port, RunConfig(workload=port.name, devices=1, steps_per_call=2, calls=1, batch_size=4))
    whole = port.make_data(np.random.default_rng(0), 2, 4)  # [steps, G, ...]
    assert jax.tree.map(np.shape, seen[-1]) == jax.tree.map(lambda v: (1, *v.shape[2:]), whole)
    with open(os.path.join(ROOT, 'docs', 'port.md')) as f:
        guide = ' '.join(f.read().split())
    assert 'a batch of one example, its batch axis kept: every leaf of shape `[1, ...]`' in guide


# -- randomness inside the model ---------------------------------------------------------------------


def _without_bridge_on_the_nnx_side(monkeypatch):
    """Negative control: NNX Dropout draws from its own stream, as it would outside the suite."""
    original = randomness.bridged

    def nnx_unbridged(rng_mode, axis_name=None, example_keys=None):
        if axis_name is None:  # the NNX side (the legacy side names its pmap axis)
            import contextlib

            return contextlib.nullcontext()
        return original(rng_mode, axis_name, example_keys)

    monkeypatch.setattr(randomness, 'bridged', nnx_unbridged)


@pytest.mark.parametrize('port', [my_port.MODEL, my_port.LOOP], ids=['model', 'loop'])
def test_dropout_inside_the_model_matters_without_the_bridge_the_paths_differ(port, monkeypatch):
    require_devices(4)
    # what is checked is the bridge (the fixed screen; a run that fails it is judged by its measured floor);
    # the unbridged control below goes through the whole verdict
    assert harness.check(port, devices=4, verdict='screen', **QUICK).report.match
    _without_bridge_on_the_nnx_side(monkeypatch)
    unbridged = harness.check(port, devices=4, diagnose=False, **QUICK)
    assert not unbridged.report.match and 'losses/per_step' in _bad(unbridged)


def test_the_bridge_draws_what_both_dropout_layers_draw_from_a_key():
    """In a loop port the mask comes from the key the user's code gave the layer: the bits are
    the ones ``nn.Dropout`` and ``nnx.Dropout`` draw themselves from that key folded with the call index."""
    from equivalence.core.rng import randomness

    key, x = jax.random.PRNGKey(3), jax.random.normal(jax.random.PRNGKey(4), (16, 32))
    own = nn.Dropout(0.25, deterministic=False).apply({}, x, rng=jax.random.fold_in(key, 0))
    with randomness.bridged('per-device'):  # outside pmap: one draw from the given key, as the layers
        linen = jax.jit(lambda x: nn.Dropout(0.25, deterministic=False).apply({}, x, rngs={'dropout': key}))(x)
        layer = nnx.Dropout(0.25, rngs=nnx.Rngs(dropout=0))
        nnx_out = jax.jit(lambda x: layer(x, rngs=key))(x)
    np.testing.assert_array_equal(linen, own)
    np.testing.assert_array_equal(nnx_out, own)
    assert not np.array_equal(nn.Dropout(0.25, deterministic=False).apply({}, x, rng=key), own)


# -- the API from a program, explain and bench on a port ----------------------------------------------


def test_api_from_a_program_that_already_chose_its_devices():
    """The check, then the command's main, in one program: the command compiles what the check did, so the
    program shares its compiled programs as this worker does (``shared_programs``: no number changes)."""
    code = (
        'import jax; jax.config.update("jax_num_cpu_devices", 4); jax.devices()\n'
        'from tests import shared_programs; shared_programs.install()\n'
        'import sys; sys.path.insert(0, sys.argv[1]); import my_port\n'
        'from equivalence import check, run\n'
        'r = check(my_port.MODEL, steps_per_call=1, calls=1)\n'
        'print(r.config.devices, r.report.match)\n'
        'print("exit", run.main(["--workload", "my_port:MODEL", "--steps-per-call", "1", "--calls", "1"]))\n'
    )
    environ = without_device_count(at_level_0(dict(os.environ)))  # only MATCH and exit codes are read
    proc = subprocess.run(
        [sys.executable, '-c', code, EXAMPLE], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '4 True' in proc.stdout and 'exit 0' in proc.stdout and 'on 4 cpu device(s)' in proc.stdout


def test_explain_and_bench_read_a_loop_port():
    require_devices(2)
    from equivalence import explain
    from equivalence.bench import variants
    from equivalence.core.port.config import RunConfig

    config = RunConfig('mlp-port-loop', devices=2, steps_per_call=2, calls=1, batch_size=64, rng_mode='global')
    for m in explain.measure_both(my_port.LOOP, config):
        assert explain.answers(m)['replicated']['yes'], m.path
        grads = explain.gradient_operands(m)
        assert len(grads) == 6, (m.path, grads)  # fc1, norm, fc2: kernel or scale, and bias
    nnx_params = [p.name for p in m.placements if p.group == 'params']
    assert '0/fc1/kernel' in nnx_params
    prepared = harness.prepare(my_port.LOOP, dataclasses.replace(config, calls=1), 4)
    feed = variants.Feed(prepared.kind, prepared.inputs, config, pool_steps=4)
    first = {}
    for v in variants.build_loop(my_port.LOOP, config, feed, k_scaling=2):
        first[v.name] = v.host_losses(v.call(v.place(1)[0]))
    assert set(first) == {'legacy', 'nnx', 'legacy_k1', 'nnx_k1'}
    np.testing.assert_allclose(first['nnx'], first['legacy'], rtol=1e-5, atol=1e-6)


def test_built_in_workloads_are_model_ports():
    from equivalence.core.port.ports import ModelPort

    assert all(isinstance(wl, ModelPort) for wl in workloads.WORKLOADS.values())
    assert workloads.get('my_port:MODEL') is my_port.MODEL


def test_a_one_key_loop_handed_per_device_keys_is_told_the_fix():
    """A new side that takes one key a call, checked with per-device keys (the port left ``rng_modes`` at its
    default, per-device first): the pre-flight's line names the fix, ``rng_modes=('global',)`` or the per-device
    recipe, not JAX's 'split accepts a single key' alone."""
    from equivalence.core.port.config import RunConfig
    from equivalence.core.preflight import PreflightError

    require_devices(2)
    port = dataclasses.replace(my_port.LOOP, name='one-key', rng_modes=('per-device', 'global'))
    config = RunConfig(workload=port.name, devices=2, steps_per_call=2, calls=1, batch_size=8)
    with pytest.raises(PreflightError) as refused:
        harness.prepare(port, config)
    assert 'new_call raised ValueError: split accepts a single key' in str(refused.value)
    assert (
        "fix: the step takes one key and was handed per-device keys ([2, 2]): give the port rng_modes=('global',)"
        in str(refused.value)
    )
