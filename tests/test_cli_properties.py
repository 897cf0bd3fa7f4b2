"""Property: whatever a user types, a command answers with a verdict or one line; never a traceback.

Flag values are drawn valid and invalid: zero, negative, too large, non-finite, wrongly
typed, and report targets that are directories, on a missing parent or an existing file.
``valid`` below states the documented rules independently of the code; each command's
own validation (``cli.validate(inputs)``: what ``python -m equivalence.<cmd>`` does before
any work) must agree with it: valid input is accepted silently, invalid input exits 2 with
exactly one ``error:`` line, and a value that line suggests is itself valid. Then a few
drawn ``run`` command lines run for real, through the command's ``main`` in this process: valid
gives 0, 1 or 5, invalid 2, and no traceback.
"""

import contextlib
import dataclasses
import functools
import importlib
import io
import json
import math
import os
import re
import tempfile

import numpy as np
import pytest
from conftest import message_lines
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from equivalence import cli, pitfalls
from equivalence.core.port.config import MAX_EXAMPLES, RNG_MODES
from equivalence.core.port.workloads import WORKLOADS

# Compiled at XLA's level 0 in this worker (conftest.at_level_0_in_process), as the subject allows:
AT_LEVEL_0 = 'exit codes and one-line errors for every input'

COMMANDS = {
    'run': 'equivalence.run',
    'explain': 'equivalence.explain.__main__',
    'bench': 'equivalence.bench.__main__',
    'pitfalls': 'equivalence.pitfalls.__main__',
}
CASES = pitfalls.names()
SEED_LIMIT = 2**32  # np.random.default_rng and jax.random.PRNGKey both take 0 <= seed < 2**32 without loss
MAX_REPEATS, BENCH_DATA_K = 1000, 100  # bench: repeats; the data of a call covers max(K, 100) steps


class Wrong(str):
    """Text that is not a value of the flag's type."""


def counts(good: st.SearchStrategy, too_large: int) -> tuple:
    bad = st.integers(max_value=0) | st.integers(too_large, 10**25) | wrongly_typed(int)
    return good, bad


AWKWARD = st.sampled_from(['--', '-', '']).map(Wrong)  # argparse's own corners: '--devices=--' once crashed


def wrongly_typed(kind) -> st.SearchStrategy:
    texts = ['many', '1.5', '1e3', '0x10', '3 4'] if kind is int else ['abc', '1,5', '1e', '0x1p', '0,5']
    return st.sampled_from(texts).map(Wrong) | AWKWARD


def words(taken) -> st.SearchStrategy:
    return st.text('abcdefgilmnoprs-_0123456789', max_size=10).filter(lambda s: s not in taken) | AWKWARD


RUN_FLAGS = {
    'workload': (st.sampled_from(list(WORKLOADS)), words(WORKLOADS)),
    'devices': counts(st.integers(1, 8), 9),
    'steps-per-call': counts(st.integers(1, 6), 10**6),
    'calls': counts(st.integers(1, 6), 10**6),
    'batch-size': counts(st.sampled_from([8, 16, 24, 48, 64, 96, 120, 128]) | st.integers(1, 128), MAX_EXAMPLES),
    'seed': (st.integers(0, SEED_LIMIT - 1), st.integers(max_value=-1) | st.integers(SEED_LIMIT, 10**30)),
    'rng': (st.sampled_from(RNG_MODES), words(RNG_MODES)),
}
PERTURB = (
    st.floats(-1, 1000, exclude_min=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0])
    | st.floats(min_value=1000, exclude_min=True, allow_nan=False)
    | st.floats(max_value=-1, allow_nan=False)
    | wrongly_typed(float),
)
REPEATS = counts(st.integers(1, 5), MAX_REPEATS + 1)
JSON = (  # names inside the ``place`` fixture; 'old.json' is good only with --overwrite, 'null' is os.devnull
    st.sampled_from(['new.json', 'old.json']),
    st.sampled_from(['adir', 'missing/r.json', 'afile/r.json', 'new/', '', 'null']),
)
PLOT = (st.sampled_from(['figs', 'adir', 'figs-old']), st.sampled_from(['afile', 'missing/figs', '']))
FLAGS = {
    'run': {**RUN_FLAGS, 'perturb': PERTURB, 'json': JSON, 'plot': PLOT},
    'explain': {**RUN_FLAGS, 'json': JSON},
    'bench': {**RUN_FLAGS, 'repeats': REPEATS, 'compile-repeats': REPEATS, 'json': JSON},
    'pitfalls': {'only': (st.sampled_from(CASES), words(CASES)), 'json': JSON},
}


@st.composite
def command_lines(draw, command: str) -> tuple[dict, set, int]:
    """Flags mostly valid and coherent, none, one or two drawn from the invalid values; switches; devices seen."""
    available = draw(st.sampled_from([8, 8, 8, 3, 1]), label='devices available')
    switches = {s for s in ('overwrite', 'list') if draw(st.booleans()) and (s != 'list' or command == 'pitfalls')}
    n_broken = draw(st.sampled_from([0, 1, 1, 2]))
    broken = draw(st.lists(st.sampled_from(sorted(FLAGS[command])), min_size=n_broken, max_size=n_broken, unique=True))
    flags = {}
    for name, (good, bad) in FLAGS[command].items():
        if name in broken:
            flags[name] = draw(bad)
        elif draw(st.booleans()):
            flags[name] = draw(coherent(name, good, flags, switches, available))
    d, wl = flags.get('devices', available), WORKLOADS.get(flags.get('workload', 'mlp'))
    if 'batch-size' in FLAGS[command] and 'batch-size' not in flags and isinstance(d, int) and 0 < d < 9 and wl:
        if wl.default_batch % d:  # e.g. 64 on 3 devices: give a batch, or the line is invalid whatever else
            flags['batch-size'] = draw(coherent('batch-size', None, flags, switches, available))
    return flags, switches, available


def coherent(name: str, good: st.SearchStrategy, flags: dict, switches: set, available: int) -> st.SearchStrategy:
    """Mostly devices that exist, a batch they divide, a report it may write: most unbroken lines are valid."""
    devices = flags.get('devices', available)
    if name == 'devices':
        return st.integers(1, available) | st.integers(1, available) | good
    if name == 'batch-size' and isinstance(devices, int) and 0 < devices < 9:
        divisible = st.integers(1, 16).map(lambda n: n * devices)
        return divisible if good is None else divisible | divisible | good
    if name in ('json', 'plot') and 'overwrite' not in switches:
        return st.just({'json': 'new.json', 'plot': 'figs'}[name]) | good
    return good


def argv(flags: dict, switches: set, place: str, joined: list[bool]) -> list[str]:
    """The typed command line: ``--flag value`` or ``--flag=value``; targets inside ``place``."""
    out = [f'--{s}' for s in sorted(switches)]
    for (name, value), join in zip(flags.items(), joined, strict=True):
        if name in ('json', 'plot'):
            value = os.devnull if value == 'null' else (os.path.join(place, value) if value else '')
        text = repr(value) if isinstance(value, float) else str(value)
        out += [f'--{name}={text}'] if join else [f'--{name}', text]
    return out


def target_ok(flag: str, target: str | None, overwrite: bool) -> bool:
    """A --json file that is new or (with --overwrite) a file; a --plot directory, new, empty or (ditto) used."""
    good = {'json': ('new.json', 'old.json'), 'plot': ('figs', 'adir', 'figs-old')}[flag]
    return target is None or target in (good if overwrite else good[:-1])


def valid(command: str, flags: dict, switches: set, available: int) -> bool:
    """The documented rules, written independently of the code under test."""
    if any(isinstance(v, Wrong) for v in flags.values()):
        return False
    if not all(target_ok(flag, flags.get(flag), 'overwrite' in switches) for flag in ('json', 'plot')):
        return False
    if command == 'pitfalls':
        return flags.get('only', CASES[0]) in CASES and ('list' in switches or available >= 2)
    if flags.get('workload', 'mlp') not in WORKLOADS or flags.get('rng', 'per-device') not in RNG_MODES:
        return False
    d, g = (
        flags.get('devices', available),
        flags.get('batch-size', WORKLOADS[flags.get('workload', 'mlp')].default_batch),
    )
    k, c = flags.get('steps-per-call', 5), flags.get('calls', 20 if command == 'bench' else 4)
    perturb, seed = flags.get('perturb', 0.0), flags.get('seed', 0)
    if min(d, g, k, c) < 1 or d > available or not 0 <= seed < SEED_LIMIT:
        return False
    if not (math.isfinite(perturb) and -1 < perturb <= 1000) or g % d:
        return False
    data_k = BENCH_DATA_K if command == 'bench' else 1
    repeats = [flags.get('repeats', 1), flags.get('compile-repeats', 1)]
    return c * max(k, data_k) * g <= MAX_EXAMPLES and all(1 <= r <= MAX_REPEATS for r in repeats)


def suggestions(line: str) -> list[tuple[str, int]]:
    """The ``--flag value`` alternatives an error line offers."""
    m = re.search(r'use (?:--batch-size (\d+)(?: or (\d+))?, or )?--devices in \[([\d, ]*)\]', line)
    if not m:
        return []
    batches = [('batch-size', int(b)) for b in m.groups()[:2] if b]
    return batches + [('devices', int(d)) for d in m.group(3).split(', ') if d]


@pytest.fixture(scope='module')
def place():
    """Report targets of every kind; validation must leave them as they are."""
    with tempfile.TemporaryDirectory() as d:
        for name in ('old.json', 'afile', 'figs-old/losses.png'):
            os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
            open(os.path.join(d, name), 'w').write('precious')
        os.mkdir(os.path.join(d, 'adir'))
        yield d
        assert sorted(os.listdir(d)) == ['adir', 'afile', 'figs-old', 'old.json'] and not os.listdir(d + '/adir')


def validate(command: str, args: list[str], available: int) -> tuple[int | None, str]:
    """The command's own pre-work path, in-process: exit code (None: accepted) and what it printed."""
    inputs = functools.partial(importlib.import_module(COMMANDS[command]).inputs, n_available=available)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.validate(inputs, args)
            code = None
        except SystemExit as e:
            code = e.code
    return code, out.getvalue() + err.getvalue()


@pytest.mark.parametrize('command', list(COMMANDS))
@settings(max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_validation_follows_the_rules_and_answers_in_one_line(command, place, data):
    flags, switches, available = data.draw(command_lines(command))
    joined = data.draw(st.lists(st.booleans(), min_size=len(flags), max_size=len(flags)))
    args = argv(flags, switches, place, joined)
    code, printed = validate(command, args, available)
    event('valid' if valid(command, flags, switches, available) else 'invalid: ' + printed.split(':')[1][:24])
    if valid(command, flags, switches, available):
        assert code is None and printed == '', (args, printed)
        return
    assert code == 2 and printed.count('\n') == 1 and printed.startswith('error: '), (args, printed)
    for name, value in suggestions(printed):  # a suggestion must itself be valid input
        assert valid(command, {**flags, name: value}, switches, available), (args, printed, name, value)
    if 'pass --overwrite' in printed:  # and the target it names is one that --overwrite may replace
        flag = 'plot' if 'losses.png' in printed else 'json'
        assert target_ok(flag, flags[flag], overwrite=True), (args, printed)


@st.composite
def small_runs(draw) -> tuple[dict, set]:
    """``run`` lines that finish in seconds: tiny K, C and batch on mlp, or one flag made invalid. Not score:
    its MISMATCH, diagnosed and located, took 12 of this test's 14 s; its verdicts, exit codes and JSON are
    test_equivalence's, test_cli's and test_checkpoint's."""
    flags = {'steps-per-call': draw(st.integers(1, 2)), 'calls': draw(st.integers(1, 2))}
    flags['devices'] = draw(st.sampled_from([1, 2, 4, 8]))
    flags['batch-size'] = flags['devices'] * draw(st.sampled_from([1, 2, 4]))
    flags |= {'workload': 'mlp', 'seed': draw(RUN_FLAGS['seed'][0])}
    flags |= {'rng': draw(RUN_FLAGS['rng'][0]), 'perturb': draw(st.sampled_from([0.0, 1e-3, -0.5, 1000.0]))}
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(FLAGS['run'])))
        flags[name] = draw(FLAGS['run'][name][1])
    return flags, set()


def run_command(args: list[str]) -> tuple[int, str, str]:
    """``python -m equivalence.run args`` through its own ``main``, in-process (the checks' programs shared with
    this worker's; the command's exit codes as a process: test_cli.py): exit code, stdout, stderr."""
    from equivalence import run

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run.main(args)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=4, deadline=None, derandomize=True)
@given(run=small_runs())
def test_run_for_real_exits_0_1_or_5_on_valid_input_and_2_on_invalid(run):
    """Valid input gets a verdict: MATCH (0), MISMATCH (1) or NOT VERIFIED (5, e.g. a batch of 1 on 1
    device, where no twin fits to measure the floor); invalid input one line and exit 2."""
    flags, switches = run
    with tempfile.TemporaryDirectory() as place:
        report = os.path.join(place, 'new.json')
        flags.setdefault('json', 'new.json')
        code, stdout, stderr = run_command(argv(flags, switches, place, [False] * len(flags)))
        assert 'Traceback' not in stdout + stderr
        if valid('run', flags, switches, 8):
            assert code in (0, 1, 5), stderr
            said = json.load(open(report))
            assert said['match'] is (code == 0)
            assert bool(said['verdict']['not_verified']) is (code == 5), said['verdict']
        else:
            assert code == 2 and stderr.count('\n') == 1 and stderr.startswith('error: '), stderr


# -- ports: a known-good port with one field replaced by a wrong value ------------------------------

NOT_CALLABLE = st.sampled_from([0, 'text', [1, 2], {'a': 1}, 2.5]) | st.just(np.zeros(3))
RETURNS = st.sampled_from([None, 0, 'x', (1, 2, 3)]) | st.just(np.zeros((2, 3)))
PORT_FIELDS = {  # field -> (arity the suite calls it with, the good ports that have it)
    'make_data': 3, 'init_args': 1, 'legacy_model': 0, 'nnx_model': 1, 'legacy_state': 1, 'legacy_step': 2,
    'new_state': 1, 'new_call': 3, 'legacy_groups': 1, 'new_groups': 1, 'legacy_loss': 5, 'nnx_loss': 3,
    'make_tx': 1,
}  # fmt: skip
OTHER_FIELDS = {  # wrong values of fields that are not callables
    'rng_modes': st.sampled_from(['global', ('per_device',), (), None, ('global', 7)]),
    'names': st.sampled_from([3, 2.5, ['Dense_0'], {'Dense_0': 1}, 'structur']),
    'axis_name': st.sampled_from([None, '', 3, ('batch',)]),
    'default_batch': st.sampled_from([0, -8, 2.5, '64', True]),
}


def function_of(n: int, value=0):
    """A function of ``n`` positional arguments returning ``value``."""
    return eval(f'lambda {",".join("abcdef"[:n])}: v', {'v': value})  # noqa: S307


def wrong_callable(arity: int) -> st.SearchStrategy:
    """A function of another arity, or of the right arity returning something of another type or shape."""
    other = st.sampled_from([n for n in range(6) if n != arity]).map(function_of)
    right = RETURNS.map(lambda value: function_of(arity, value))
    return NOT_CALLABLE | other | right


@st.composite
def broken_ports(draw) -> tuple[str, str, object]:
    """(level, field, wrong value): one field of the example's good port replaced."""
    level = draw(st.sampled_from(['LOOP', 'MODEL']))
    import hostile_ports

    good = getattr(hostile_ports, level)
    fields = [f for f in (*PORT_FIELDS, *OTHER_FIELDS) if f in {x.name for x in dataclasses.fields(good)}]
    field = draw(st.sampled_from(fields), label='field')
    value = draw(wrong_callable(PORT_FIELDS[field]) if field in PORT_FIELDS else OTHER_FIELDS[field], label='value')
    return level, field, value


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=broken_ports())
def test_a_port_with_one_wrong_field_is_exit_2_in_one_line_naming_a_port_field(case, monkeypatch_module):
    """Built (``loading.load``) and run (``python -m equivalence.run``, in-process): one line, exit 2,
    naming a field of the port, the replaced one when its kind or arity is wrong; nothing trains."""
    import dataclasses

    import hostile_ports

    from equivalence.core.port import ports

    level, field, value = case
    hostile_ports.DRAWN = lambda: dataclasses.replace(getattr(hostile_ports, level), **{field: value})
    argv = ['--workload', 'hostile_ports:DRAWN', '--devices', '2', '--steps-per-call', '2', '--calls', '2',
            '--batch-size', '8']  # fmt: skip
    code, out, err = run_command(argv)
    said = message_lines(err)  # the stages it ran said before, if any
    line = '\n'.join(said) + '\n'
    event(f'{field}: ' + line.split(': ', 2)[-1][:40])
    assert code == 2 and len(said) == 1 and line.startswith('error: '), (field, value, code, err)  # no traceback
    named = {f.name for f in dataclasses.fields(ports.LoopPort)} | {f.name for f in dataclasses.fields(ports.ModelPort)}
    assert any(f in line for f in named), line
    if not callable(value) or field in OTHER_FIELDS:
        assert field in line, line


@pytest.fixture(scope='module')
def monkeypatch_module():
    """No training step may run: the pre-flight (or the port's own checks) must stop every drawn port."""
    from equivalence.core.run import setups

    def trained(*args, **kwargs):
        raise AssertionError('a training step ran')

    with pytest.MonkeyPatch.context() as patch:
        for setup in (setups.LegacySetup, setups.NnxSetup, setups.LoopNewSetup):
            patch.setattr(setup, 'call', trained)
        yield
