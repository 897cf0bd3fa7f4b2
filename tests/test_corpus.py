"""The verdict corpus (issue 16, point 5): a cheap subset of its entries, each verdict asserted.
A LayerNorm epsilon as ``math`` is ``test_verdict``'s (the corpus's Transformer entries, its correct
port and its slip, are left to the command: the correct port's zero-gradient attention key bias is the
same case as ``bias-before-bn``'s, which sits nearer the NOT VERIFIED line); the BatchNorm momentum
slip as ``state`` is ``test_locate``'s, through the whole check (its kind, and where: the statistics at
that BatchNorm).

Correct ports must MATCH and slips MISMATCH, naming the slip's kind. The whole corpus, at 1, 2,
4 and 8 devices and over seeds, is ``python -m equivalence.corpus`` (docs/trials.md has its
last measured confusion matrix).
"""

import subprocess
import sys
import types

import pytest

from equivalence import corpus
from equivalence.core.compare.outcome import Outcome
from equivalence.corpus import runner
from equivalence.corpus.__main__ import main
from tests.conftest import require_devices

DEVICES = 2
TINY = {'steps_per_call': 2, 'calls': 1}  # compile dominates; the first steps are where slips show
RUNS = {  # entry -> (devices, RunConfig overrides)
    'bias-before-bn': (DEVICES, TINY),
    'mlp-bf16-momentum': (DEVICES, {}),  # the entry's 20 steps: bfloat16 rounds the moments apart later
    'mlp-bf16-lr-1e-2': (DEVICES, {}),
}  # mlp-perturb-1e-5 (inside the old fixed tolerance, outside its measured floor): test_verdict.py, as 'optimizer'


@pytest.fixture(scope='module')
def cases() -> dict[str, runner.Case]:
    require_devices(DEVICES)
    entries = {e.name: e for e in corpus.select(list(RUNS))}
    return {name: runner.run_case(entries[name], d, seed=0, **flags) for name, (d, flags) in RUNS.items()}


@pytest.mark.parametrize(
    'name',
    [
        'bias-before-bn',  # bias before BatchNorm: gradient 0, Adam amplifies rounding (noise-dominated)
        'mlp-bf16-momentum',  # judged in its own precision: a bfloat16 moment's flip is not a slip
    ],
)
def test_correct_port_matches(cases, name):
    case = cases[name]
    assert case.outcome is Outcome.MATCH, f'{name}: {case.verdict} ({case.detail})'


@pytest.mark.parametrize(
    'name',
    [
        'mlp-bf16-lr-1e-2',  # mlp-bf16-momentum under a 1% learning-rate slip, far outside bfloat16's rounding
        # bn-momentum: test_locate's BatchNorm momentum, 'state' and located at the BatchNorm
    ],
)
def test_slip_mismatches_with_its_kind(cases, name):
    case = cases[name]
    assert case.outcome is Outcome.MISMATCH, f'{name}: {case.verdict} ({case.detail})'
    assert not case.wrong_kind, f'{name}: diagnosed {case.kind!r}, the slip is {case.expected_kind!r}'


def fake_case(truth: str, outcome: Outcome | None, kind: str | None = None) -> runner.Case:
    return runner.Case('e', truth, 'math' if truth == 'slip' else None, 2, 0, outcome, kind, 1.0)


def test_a_wrong_verdict_is_counted_and_a_missing_diagnosis_tolerated():
    """The judge itself: which verdicts are wrong, and the diagnosis read whether or not the verdict has one."""
    match, mismatch, error = Outcome.MATCH, Outcome.MISMATCH, None  # None: the run raised
    wrong = {(t, v, k): fake_case(t, v, k).wrong for t, v, k in [
        ('correct', match, None), ('correct', mismatch, None), ('correct', error, None),
        ('slip', mismatch, None), ('slip', mismatch, 'math'), ('slip', mismatch, 'optimizer'),
        ('slip', match, None),
    ]}  # fmt: skip
    assert [k for k, w in wrong.items() if w] == [
        ('correct', mismatch, None), ('correct', error, None), ('slip', mismatch, 'optimizer'),
        ('slip', match, None),
    ]  # fmt: skip
    assert fake_case('slip', error).to_json()['verdict'] == 'ERROR'
    assert fake_case('slip', Outcome.NOT_VERIFIED).to_json()['verdict'] == 'NOT VERIFIED'
    today = types.SimpleNamespace(report=types.SimpleNamespace(match=False))
    assert runner.diagnosis_kind(today) is None
    assert (
        runner.diagnosis_kind(types.SimpleNamespace(diagnosis=types.SimpleNamespace(kind='math'), report=None))
        == 'math'
    )
    assert (
        runner.diagnosis_kind(types.SimpleNamespace(report=types.SimpleNamespace(diagnosis='randomness')))
        == 'randomness'
    )


def test_command_lists_every_entry_and_refuses_bad_input(capsys):
    assert main(['--list']) == 0
    listed = [line.split()[:2] for line in capsys.readouterr().out.splitlines()]
    assert listed == [[e.name, e.truth] for e in corpus.entries()]
    assert {'correct', 'slip'} == {truth for _, truth in listed}
    bad = {
        '--only nope': "unknown corpus entry 'nope'",
        '--devices 2,x': '--devices must be counts',
        '--devices 0': '--devices must be at least 1',
        '--seeds 0': '--seeds must be at least 1',
    }
    for argv, message in bad.items():
        with pytest.raises(SystemExit) as e:
            main(argv.split())
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith('error: ') and message in err[0], err


def test_importing_the_corpus_imports_no_jax():
    code = 'import sys, equivalence.corpus, equivalence.corpus.__main__; assert "jax" not in sys.modules'
    subprocess.run([sys.executable, '-c', code], check=True, timeout=60)
