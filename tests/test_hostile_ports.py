"""A corpus of hostile ports: each a realistic mistake in a user's port, tried through every
command that takes a port. Each must end in exit 2 with one ``error:`` line that names the
port field at fault, no traceback and no exit 3; all but the last few are stopped by the
pre-flight before any training step runs (``tests/hostile_ports.py`` holds the ports)."""

import contextlib
import functools
import io
import os
import re
import tempfile
import time

import hostile_ports
import jax
import optax
import pytest
from conftest import message_lines, run_module
from flax import traverse_util

from equivalence.core.run import setups

# Compiled at XLA's level 0 in this worker (conftest.at_level_0_in_process), as the subject allows:
AT_LEVEL_0 = "each hostile port's one-line error, mostly before any step runs"

QUICK = ['--devices', '2', '--steps-per-call', '2', '--calls', '2', '--batch-size', '8']
COMMANDS = {
    'run': ('equivalence.run', QUICK),
    'explain': ('equivalence.explain.__main__', QUICK),
    'bench': (
        'equivalence.bench.__main__',
        [*QUICK[:6], '--calls', '1', '--batch-size', '8', '--repeats', '1', '--compile-repeats', '1'],
    ),  # fmt: skip
    'record': ('equivalence.record', QUICK),  # and --out, in the test's folder
}
TRAINS_FIRST = {'nnx_call_fails_while_training'}  # shows only while training: the frame, not the pre-flight
CASES = [(name, command) for name, (_, commands) in hostile_ports.CASES.items() for command in commands]
# record runs the pmap side's half of the pre-flight (it never builds the new side): the mistakes there that run
# refuses, it refuses too, each with its one line, before anything trains and with no file written (issue 60)
PMAP_SIDE = ('legacy_step', 'legacy_loss', 'legacy_state', 'legacy_groups', 'axis_name', 'make_tx', 'noise')
CASES += [(name, 'record') for name, (field, _) in hostile_ports.CASES.items() if field in PMAP_SIDE]
CASES += [(name, 'record') for name in ('data_batch_first', 'data_raises', 'legacy_model_needs_arguments')]


def _main(command: str):
    import importlib

    return importlib.import_module(COMMANDS[command][0]).main


def invoke(main, argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def no_training(monkeypatch, request):
    """Any compiled call of either path fails the test: the pre-flight must have stopped the port."""
    if request.node.callspec.params['case'][0] in TRAINS_FIRST:
        return

    def trained(*args, **kwargs):
        raise AssertionError('a training step ran before the mistake was reported')

    for setup in (setups.LegacySetup, setups.NnxSetup, setups.LoopNewSetup, setups.NnxGraphSetup):
        monkeypatch.setattr(setup, 'call', trained)


def command_line(name: str, command: str, tmp_path) -> tuple:
    workload = f'hostile_ports:{name}'
    if command == 'migrate':
        from equivalence.checkpoint.__main__ import main

        return main, ['migrate', str(tmp_path / 'legacy'), str(tmp_path / 'nnx'), '--workload', workload]
    module, flags = COMMANDS[command]
    out = ['--out', str(tmp_path / 'reference.npz')] if command == 'record' else []
    return _main(command), ['--workload', workload, *flags, *out]


def pytest_helper(name: str) -> tuple[int, str, str]:
    """``assert_port_matches`` as a team's test calls it: a failed test with one line, or a pass."""
    from equivalence.core.port import loading
    from equivalence.core.port.config import ConfigError
    from equivalence.testing import assert_port_matches

    try:
        port = loading.load(f'hostile_ports:{name}')
        assert_port_matches(port, devices=2, batch_size=8)
    except ConfigError as e:  # the port refused to be built: the line its author sees at import
        return 2, '', f'error: {e}\n'
    except pytest.fail.Exception as e:
        return 2, '', str(e) + '\n'
    return 0, '', ''


@pytest.mark.parametrize('case', CASES, ids=[f'{c}-{n}' for n, c in CASES])
def test_a_hostile_port_is_one_line_naming_its_field(case, no_training, tmp_path):
    name, command = case
    field = hostile_ports.CASES[name][0]
    t0 = time.monotonic()
    if command == 'pytest':
        code, out, err = pytest_helper(name)
    else:
        code, out, err = invoke(*command_line(name, command, tmp_path))
    seconds = time.monotonic() - t0
    lines = message_lines(err)
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith('error: '), err
    assert f'{field}' in lines[0], (field, lines[0])
    assert seconds < 15 or name in TRAINS_FIRST, f'{seconds:.1f} s'
    if command == 'migrate':
        assert not (tmp_path / 'nnx').exists()
    if command == 'record':
        assert os.listdir(tmp_path) == []


def test_a_pmapped_step_handed_over_is_one_line_saying_so_and_what_to_pass():
    """AlgoPerf MNIST's ``jax.pmap``'d update function, its static arguments bound by ``functools.partial``, was
    exit 2 'legacy_step raised IndexError: tuple index out of range' after the pre-flight traced it (issue 51),
    and handed over as it is 'cannot be called as ...': the port refuses to be built, with the line that says it
    is pmapped and what to pass instead (the function it wraps, ``__wrapped__``, with ``axis_name=``)."""
    from equivalence.core.port.config import ConfigError

    for name, instead in (
        ('legacy_step_pmapped_with_its_static_arguments_bound', 'functools.partial(pmapped_update_params.__wrapped__,'),
        ('legacy_step_pmapped_as_is', 'pmapped_update_params.__wrapped__'),
    ):
        with pytest.raises(ConfigError) as e:
            getattr(hostile_ports, name)()
        line = str(e.value)
        assert '\n' not in line and "jax.pmap'd" in line and instead in line and "axis_name='batch'" in line, line
    # what the line says to pass: traced by the pre-flight, as the run will call it (the positive control)
    from equivalence.core import kinds, preflight
    from equivalence.core.port.config import RunConfig

    wrapped = hostile_ports.pmapped_update_params.__wrapped__
    port = hostile_ports.loop(legacy_step=functools.partial(wrapped, 'mnist', hostile_ports.old.make_tx().update))
    config = RunConfig(workload=port.name, devices=2, batch_size=8, steps_per_call=2, calls=2,
                       rng_mode=port.rng_modes[0])  # fmt: skip
    preflight.check(kinds.of(port), config)


def _decay_mask_of_linen_dicts(params):  # written for linen's params dict, as linen-era code writes it
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({path: path[-1] != 'bias' for path in flat})


def _decay_mask_of_any_tree(params):  # the same mask, as the line's fix says: read from each leaf's path
    return jax.tree_util.tree_map_with_path(lambda path, _: 'bias' not in jax.tree_util.keystr(path), params)


def test_a_make_tx_whose_mask_reads_linen_dicts_is_blamed_with_what_the_nnx_side_hands_it():
    """A model port's ``make_tx`` serves both sides; its weight-decay mask, written for linen's params dict, fails
    on the ``nnx.State`` that ``nnx.Optimizer`` hands it. The line blamed ``nnx_model``; it names ``make_tx``, the
    mask's frame, why and the fix, and the mask written as the fix says passes (the positive control)."""
    from equivalence.core import kinds, preflight
    from equivalence.core.port.config import RunConfig

    def port(mask):
        return hostile_ports.model(make_tx=lambda scale: optax.adamw(3e-3 * scale, weight_decay=1e-4, mask=mask))

    config = RunConfig(workload='mlp-port', devices=2, batch_size=8, steps_per_call=1, calls=1)
    with pytest.raises(preflight.PreflightError) as e:
        preflight.check(kinds.of(port(_decay_mask_of_linen_dicts)), config)
    line = str(e.value)
    assert line.startswith("port 'mlp-port': make_tx raised AssertionError: ") and '\n' not in line, line
    assert 'in _decay_mask_of_linen_dicts, when nnx.Optimizer initialised it on the NNX side' in line, line
    assert "(an nnx.State, not linen's params dict); fix: " in line and 'tree_map_with_path' in line, line
    preflight.check(kinds.of(port(_decay_mask_of_any_tree)), config)


def test_a_name_that_is_not_a_port_is_the_users_mistake_named_with_its_line():
    """``--workload module:NAME`` naming a model class, or a factory whose own code raises: exit 2 naming
    NAME (and the factory's line), not exit 3: neither is a bug in the suite."""
    code, _, err = invoke(_main('run'), ['--workload', 'hostile_ports:MLP', *QUICK])
    assert code == 2 and "hostile_ports:MLP' is a class (an nnx.Module), not a port" in err, err
    code, _, err = invoke(_main('run'), ['--workload', 'hostile_ports:port_with_misspelt_field', *QUICK])
    line = err.strip()
    assert code == 2 and 'port_with_misspelt_field() raised TypeError: ' in line and "'legacy_stp'" in line, err
    assert re.search(r'at hostile_ports\.py:\d+ in port_with_misspelt_field$', line), line


def test_a_long_error_keeps_its_culprit_on_the_line_and_its_whole_text_in_a_file(tmp_path, monkeypatch):
    """A JAX error names the argument at fault in its last clause, after hundreds of characters and a
    line break: the one line keeps its head and that clause; the whole text is in the file it names."""
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
    code, _, err = invoke(_main('run'), ['--workload', 'hostile_ports:legacy_step_raises_long', *QUICK])
    [line] = message_lines(err)
    assert code == 2 and line.startswith("error: port 'mlp-port-loop': legacy_step raised ValueError: Sharding passed")
    path = line.rsplit('whole text in ', 1)[1]
    assert ' ... ' in line and 'for arg type: uint32[2,2]' in line and len(line) - len(path) < 800, line
    assert os.path.dirname(path) == str(tmp_path)
    assert 'x' * 600 + '),\narg sharding: ' in open(path).read()


def test_explain_reads_a_loop_call_that_ignores_its_key():
    code, out, err = invoke(_main('explain'), ['--workload', 'hostile_ports:keyless_loop', *QUICK])
    assert code == 0, err
    assert 'keys' in out and 'Traceback' not in out + err


def test_under_processes_a_workers_mistake_in_the_port_is_its_one_line_not_a_dead_worker():
    """Each worker runs the pre-flight: its exit 2 and its whole line reach the launcher's stderr."""
    proc = run_module('equivalence.run', '--workload', 'hostile_ports:legacy_step_pmean_other_axis', '--processes',
                      '2', '--devices', '4', *QUICK[2:], env={'PYTHONPATH': os.path.dirname(__file__)})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    [line] = message_lines(proc.stderr)
    assert line.startswith("error: port 'mlp-port-loop': legacy_step raised NameError") and line.endswith(
        "fix: the port declares axis_name='batch': set axis_name='data' or pmean over 'batch'"
    ), line


def test_nnx_groups_is_honoured_by_resume_and_migrate(tmp_path):
    """A train state with its own names (``net``, ``opt``): ``--resume-at`` restores into it and
    ``checkpoint migrate`` maps into it, both through the port's ``new_groups=``."""
    flags = ['--workload', 'hostile_ports:grouped_loop', *QUICK, '--resume-at', '2', '--checkpoint-dir', str(tmp_path)]
    code, out, err = invoke(_main('run'), flags)
    assert code == 0, out + err  # MATCH
    migrate = command_line('grouped_loop', 'migrate', tmp_path)
    code, out, err = invoke(migrate[0], [*migrate[1][:2], str(tmp_path / 'again'), *migrate[1][3:]])
    assert code == 0, err
    rows = [r.split()[:2] for r in out.splitlines()]
    assert ['params/Dense_0/kernel', 'net/fc1/kernel'] in rows and ['step/step', 'opt/step'] in rows, out


def test_data_code_written_for_a_random_state_is_told_it_is_given_a_generator():
    """pmap-era data code calls RandomState's methods (``rng.randint``, ``rng.randn``) on what ``make_data`` is given,
    a numpy Generator (a blind port of Hugging Face's BERT did): its line says so, and how to make a RandomState."""
    import numpy as np

    from equivalence.core.preflight import errors

    with pytest.raises(AttributeError) as raised:
        hostile_ports.data_random_state_methods().make_data(np.random.default_rng(0), 2, 4)
    line = errors.line(hostile_ports.LOOP, 'make_data', raised.value)
    assert 'has no randn' in line and line.endswith('np.random.RandomState(rng.integers(2**31))'), line
