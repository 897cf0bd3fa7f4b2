"""``python -m equivalence.bench`` with tiny sizes: every JSON field is there, bad input exits 2.

No timing is asserted: speed is reported by the benchmark, not tested.
"""

import functools
import json
import os
import subprocess

import jax
import numpy as np
import pytest
from conftest import ROOT, at_level_0, run_module

from equivalence import cli
from equivalence.bench import __main__ as bench_main
from equivalence.bench import report as benchreport
from equivalence.bench import timing as measure
from equivalence.bench.variants import Variant
from equivalence.core.port.config import RunConfig

TINY = ['--devices', '2', '--repeats', '2', '--steps-per-call', '2', '--calls', '2', '--compile-repeats', '1']
VARIANTS = {'legacy', 'nnx', 'jit_bare', 'nnx_first', 'nnx_transposed', 'nnx_graph', 'nnx_cached'}
VARIANTS |= {'legacy_k1', 'nnx_k1', 'legacy_k20', 'nnx_k20'}
VARIANT_FIELDS = {
    'label',
    'steps_per_call',
    'steps_per_s',
    'baseline',
    'ratio_vs_baseline',
    'dispatch_ms',
    'call_ms',
    'cpu_ms',
    'compile_s',
    'hlo',
    'compiles_while_timed',
    'first_call',
}
HLO_FIELDS = {'all_reduce', 'all_reduce_operands_per_step', 'all_reduce_bytes', 'copy', 'transpose', 'while', 'fusion'}
HLO_FIELDS |= {'all_reduce_operands_per_call', 'aliased_bytes'}


def bench(*args: str) -> subprocess.CompletedProcess:
    """The command, compiled at XLA's level 0 (``conftest.at_level_0``): what is read is its fields and timings."""
    return run_module('equivalence.bench', *args, env=at_level_0())


def test_tiny_run_writes_every_field(tmp_path):
    out = tmp_path / 'bench.json'
    proc = bench(*TINY, '--json', str(out))
    assert proc.returncode == 0, proc.stderr
    assert '[bench mlp' in proc.stderr  # the progress line
    assert 'targets (' in proc.stdout and 'ratios are what count' in proc.stdout
    report = json.loads(out.read_text())
    assert report['workload'] == 'mlp' and report['devices'] == 2 and report['steps_per_call'] == 2
    assert report['repeats'] == 2 and report['calls_per_repeat'] == 2
    assert {'backend', 'devices_visible', 'cpu_cores', 'cpu_model', 'load_avg_1m', 'versions'} <= set(report['machine'])
    assert {'jax', 'jaxlib', 'flax', 'optax', 'python'} <= set(report['machine']['versions'])
    assert set(report['variants']) == VARIANTS
    for name, v in report['variants'].items():
        assert VARIANT_FIELDS <= set(v), name
        assert len(v['steps_per_s']['per_repeat']) == 2 and len(v['compile_s']['per_repeat']) == 1
        assert {'median', 'min', 'max'} <= set(v['steps_per_s']) & set(v['dispatch_ms']) & set(v['compile_s'])
        assert HLO_FIELDS <= set(v['hlo']) and v['hlo']['all_reduce'] >= 1
        # Not a timing: every variant computes the same first-call losses as legacy pmap.
        assert v['first_call']['agrees'], (name, v['first_call'])
    # Fix 4, read from the programs: the gradient all-reduced after the kernel transposes (as pmap's
    # pmean is) leaves none; the same call with the partitioner's placement has them (the control).
    transposes = {name: v['hlo']['transpose'] for name, v in report['variants'].items()}
    assert transposes['nnx'] == transposes['legacy'] == 0 < transposes['nnx_transposed']
    assert set(report['compile_scaling']) == {'k5', 'k100'}
    targets = report['targets']
    assert len(targets) == 4
    assert all({'name', 'value', 'op', 'threshold', 'pass', 'applies', 'per_repeat'} <= set(t) for t in targets)
    assert [len(t['per_repeat']['values']) for t in targets] == [2, 2, 2, 1]  # compile: --compile-repeats 1


def test_bad_input_exits_2_with_one_line(capsys):
    """In-process: more devices than this process's JAX sees (the devices asked of JAX, as a process asks them;
    as a process, test_cli's ``run --devices 16`` through the same ``cli.run_config``), and the bench's own flag
    (the flags it shares with run: test_cli's table, through this command too)."""
    with pytest.raises(SystemExit) as too_many:
        cli.validate(bench_main.inputs, ['--devices', str(len(jax.devices()) * 2)])
    err = capsys.readouterr().err
    assert too_many.value.code == 2 and err.count('\n') == 1 and f'JAX_NUM_CPU_DEVICES={len(jax.devices()) * 2}' in err
    with pytest.raises(SystemExit) as exit_:
        cli.validate(functools.partial(bench_main.inputs, n_available=8), ['--repeats', '0'])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count('\n') == 1 and '--repeats must be at least 1' in err, err
    with pytest.raises(SystemExit) as exit_:
        cli.validate(functools.partial(bench_main.inputs, n_available=8), ['--k-scaling', '101'])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count('\n') == 1 and '--k-scaling must be at most 100' in err, err


def test_existing_json_is_not_overwritten(tmp_path, capsys):
    """Refused by the bench's own validation, in-process (exit 2 as a process: the test above)."""
    out = tmp_path / 'bench.json'
    out.write_text('precious')
    with pytest.raises(SystemExit) as exit_:
        cli.validate(functools.partial(bench_main.inputs, n_available=8), ['--json', str(out)])
    assert exit_.value.code == 2 and 'pass --overwrite' in capsys.readouterr().err
    assert out.read_text() == 'precious'


def test_first_call_check_catches_a_different_loss():
    """Negative control for the agreement column: a loss off by 1e-4 is reported."""
    variants = [Variant(n, n, 2, None, None, None) for n in ('legacy', 'other')]
    losses = np.array([1.0, 0.5], np.float32)
    result = benchreport.BenchResult(RunConfig(), 1, {}, variants, {}, {}, {}, {'legacy': losses, 'other': losses})
    assert result.agrees(variants[1])
    result.first['other'] = losses + np.float32(1e-4)
    assert not result.agrees(variants[1])


HLO_SAMPLE = """
%body (p: (s32[], f32[20,30])) -> (s32[], f32[20,30]) {
  %a = f32[30]{0} parameter(0)
  %b = f32[20,30]{1,0} parameter(1)
  %all-reduce = (f32[30]{0}, f32[20,30]{1,0}) all-reduce(%a, %b), channel_id=1, to_apply=%add
  %transpose.1 = f32[30,20]{0,1} transpose(%b), dimensions={1,0}
  %copy.2 = f32[30,20]{1,0} copy(%transpose.1)
  ROOT %tuple = (s32[], f32[20,30]) tuple(%i, %d)
}

ENTRY %main () -> f32[5] {
  %t = (s32[], f32[20,30]) parameter(0)
  %while.3 = (s32[], f32[20,30]) while(%t), condition=%cond, body=%body
  %e = f32[5]{0} parameter(1)
  ROOT %all-reduce.4 = f32[5]{0} all-reduce(%e), channel_id=2, to_apply=%add
}
"""


def test_program_summary_counts_ops_and_where_the_all_reduces_run():
    s = measure.summarize(HLO_SAMPLE)
    assert (s['all_reduce'], s['transpose'], s['copy'], s['while']) == (2, 1, 1, 1)
    assert (s['all_reduce_operands_per_step'], s['all_reduce_operands_per_call']) == (2, 1)
    assert s['all_reduce_bytes'] == 4 * (30 + 20 * 30 + 5)


def test_cost_mode_times_a_check_and_a_slips_mismatch_against_the_two_bare_runs(tmp_path):
    """``--cost`` on a loop port and its slip, one repeat: the bare runs, the check and the slip's check
    each ran in a process of its own; the ratios are of the walls it reports; the MATCH computed the
    bare runs' losses; the MISMATCH says its diagnosis and where the sides part; the text says it all.
    No timing is asserted."""
    out = tmp_path / 'cost.json'
    example = os.path.join(ROOT, 'examples', 'mlp_port')
    args = ['--cost', '--workload', 'my_port:LOOP', '--slip', 'my_port:LOOP_EPSILON_SLIP', '--devices', '2']
    args += ['--steps-per-call', '1', '--calls', '1', '--repeats', '1', '--json', str(out)]
    proc = run_module('equivalence.bench', *args, env=at_level_0({'PYTHONPATH': os.pathsep.join([example, ROOT])}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    subjects = report['subjects']
    assert report['mode'] == 'cost' and report['repeats'] == 1 and set(subjects) == {'bare', 'match', 'mismatch'}
    bare, match, slip = subjects['bare'], subjects['match'], subjects['mismatch']
    assert bare['config'] == {'devices': 2, 'steps_per_call': 1, 'calls': 1, 'batch_size': 64, 'seed': 0,
                              'rng': 'global', 'strategy': 'dp'}  # fmt: skip
    for s in subjects.values():
        assert len(s['wall_s']['values']) == 1 and s['wall_s']['values'][0] > 0 and s['programs']['median'] > 0
        assert s['same_losses_every_repeat'] and s['process_s']['median'] >= s['wall_s']['median']
        assert s['cpu_s']['values'][0] > 0  # every thread's CPU seconds of the same work
    assert [st['name'].split(' ')[0] for st in bare['stages']] == ['inputs', 'legacy', 'new']
    assert {'pre-flight', 'inputs', 'verdict'} <= {st['name'].split(' (')[0] for st in match['stages']}
    for s in (match, slip):
        assert s['ratio_vs_bare'] == s['wall_s']['median'] / bare['wall_s']['median']
        assert s['cpu_ratio_vs_bare'] == s['cpu_s']['median'] / bare['cpu_s']['median']
    assert match['outcome'] == 'MATCH' and report['check_losses_are_the_bare_runs']
    assert slip['outcome'] == 'MISMATCH' and slip['diagnosis_kind'] == 'math' and slip['diagnosis'] and slip['where']
    assert 'epsilon 1e-06 ↔ 1e-05' in slip['where'], slip['where']
    assert [(t['threshold'], t['outcome_expected']) for t in report['targets']] == [(1.25, 'MATCH'), (2.0, 'MISMATCH')]
    assert {'cpu_cores', 'load_avg_1m', 'load_avg_1m_end', 'versions'} <= set(report['machine'])
    text = proc.stdout
    assert text.startswith('cost of a check: my_port:LOOP on 2 device(s), K=1 x C=1'), text[:200]
    assert f'{match["ratio_vs_bare"]:.2f}x' in text and slip['where'] in text and 'targets (ratio of medians)' in text


def test_a_cost_repeat_that_fails_hands_back_why_as_a_json_record(tmp_path, monkeypatch):
    """A repeat's process that fails prints a JSON record of why (its one line, whether the port's), which the
    parent reads; a port that cannot be loaded is the port's failure, as ``run`` would say it (exit 2)."""
    from equivalence.bench import cost
    from equivalence.core.port.config import RunConfig

    monkeypatch.chdir(tmp_path)  # no such module here
    config = RunConfig(workload='x', devices=1, steps_per_call=1, calls=1, batch_size=8)
    with pytest.raises(cost.RepeatFailed) as failed:
        cost.one(cost.Subject('bare', 'the bare runs', 'bare', 'no_such_module:PORT', config))
    assert failed.value.port and 'no_such_module' in str(failed.value)


def test_a_port_whose_step_runs_once_per_step_is_refused_by_the_timing_and_costed_by_cost():
    """docs/port.md said ``bench`` refuses such a port, yet ``bench --cost`` checks one. The side-by-side timing
    refuses it, naming ``--cost``; the bare runs that only ``--cost`` times run it (a check of it runs as ``run``
    runs it); and the guide says both."""
    from conftest import import_example

    from equivalence.bench import cost_process
    from equivalence.core import kinds
    from equivalence.core.port.config import ConfigError

    (example,) = import_example('linen_jit_port', 'my_port')
    port = example.PORT  # linen under jax.jit, its step called once per step on both sides
    with pytest.raises(ConfigError) as refused:
        kinds.of(port).one_program_each('bench')
    assert str(refused.value).endswith("new_call= (K steps in one call) to use it here; bench --cost times a check "
                                       'of it as it is'), refused.value  # fmt: skip
    n = len(jax.devices())  # its step is pinned to a mesh of every device this process sees
    config = RunConfig(workload=port.name, devices=n, steps_per_call=2, calls=1, batch_size=2 * n, rng_mode='global')
    bare = cost_process.bare(port, config)
    assert [len(bare['losses'][side]) for side in ('legacy', 'new')] == [2, 2], bare['losses']
    with open(os.path.join(ROOT, 'docs', 'port.md')) as f:
        guide = ' '.join(f.read().split())
    assert '`bench --cost`, which times a whole check against the two bare runs, takes such a port as it is' in guide
