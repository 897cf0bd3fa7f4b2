"""``python -m equivalence.bench`` on a loop port: its advice is backed by figures of the same run,
and memory per device stands beside speed. No timing is asserted: only that each number the advice
prints is one this run measured (read back from its own JSON).
"""

import json
import os

import pytest
from conftest import ROOT, at_level_0, run_module

from equivalence.bench import advice
from equivalence.bench import report as benchreport
from equivalence.bench.timing import Block, CompileTiming
from equivalence.bench.variants import Variant
from equivalence.core.port.config import RunConfig

# K=20 is also the bench's long-call K: no separate K=20 variants to build (the cheapest run)
TINY = ['--devices', '2', '--repeats', '2', '--steps-per-call', '20', '--calls', '2', '--compile-repeats', '1']
EXAMPLE = os.path.join(ROOT, 'examples', 'mlp_port')
MEMORY_HEADERS = ('args B/dev', 'temp B/dev', 'vs dp')


def lookup(report: dict, figure: dict) -> float:
    """The figure's value where the report keeps it: what the advice line claims to have measured."""
    v = report['variants'][figure['variant']]
    if figure['source'] == 'timed':
        return v[figure['field']]['median']
    return v['hlo' if figure['source'] == 'program' else 'facts'][figure['field']]


def printed(value: float) -> tuple[str, ...]:
    return (f'{value:.2f}', f'{value:.0f}')


@pytest.fixture(scope='module')
def loop_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench') / 'loop.json'
    proc = run_module('equivalence.bench', '--workload', 'my_port:LOOP', *TINY, '--json', str(out),
                      env=at_level_0({'PYTHONPATH': os.pathsep.join([EXAMPLE, ROOT])}))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_every_advice_line_is_backed_by_figures_of_the_same_run(loop_run):
    stdout, report = loop_run
    found = {a['name']: a for a in report['advice']}
    # Read from the compiled programs, so present whatever the timings: the port's step averages its
    # loss in every step, and its gradient is all-reduced before the kernel transposes (pmap's: after).
    assert {'loss_per_step', 'transposes', 'summary'} <= set(found), list(found)
    assert {'nnx_jit_state', 'nnx_jit_dict'} <= set(report['variants'])  # the derived forms ran
    for a in report['advice']:
        assert a['text'] in stdout, a['name']
        assert a['figures'], a['name']
        for f in a['figures']:
            assert f['value'] == lookup(report, f), (a['name'], f)
            assert any(p in a['text'] for p in printed(f['value'])), (a['name'], f, a['text'])
    assert report['not_derived'] and report['not_derived'][0] in stdout


def test_memory_per_device_stands_beside_speed(loop_run):
    stdout, report = loop_run
    speed, other = [line for line in stdout.splitlines() if line.startswith('variant')][:2]  # one row per variant
    assert 'steps/s' in speed and all(h in other for h in MEMORY_HEADERS), (speed, other)
    for name, v in report['variants'].items():
        assert v['hlo']['argument_bytes'] > 0 and v['hlo']['temp_bytes'] >= 0, name


def fake_result(dispatch_ms: dict[str, float], hlo: dict[str, dict]) -> benchreport.BenchResult:
    """A bench result with given medians and programs, two repeats of identical blocks."""
    names = ['legacy', 'nnx', 'nnx_jit_state', 'nnx_jit_dict']
    variants = [Variant(n, n, 5, None, None, None) for n in names]
    variants[1].facts.update(state_kind='objects', state_arrays=10, donated_arrays=0)
    blocks = {n: [Block(100.0, dispatch_ms[n], 5.0, 5.0, 0)] * 2 for n in names}
    base = {'argument_bytes': 1000, 'temp_bytes': 500, 'copy': 10, 'transpose': 0}
    base |= {'all_reduce_scalars_per_step': 0, 'all_reduce_operands_per_step': 4, 'aliased_bytes': 0}
    compiles = {n: CompileTiming([1.0], {**base, **hlo.get(n, {})}) for n in names}
    return benchreport.BenchResult(RunConfig(), 2, {}, variants, blocks, compiles, {}, {}, ['not derived'])


def test_advice_follows_the_measured_numbers_not_a_fixed_text():
    """Negative control: other numbers give other lines, and no line where nothing was measured."""
    slow = {'legacy': 1.0, 'nnx': 3.1, 'nnx_jit_state': 0.9, 'nnx_jit_dict': 0.7}
    programs = {'nnx': {'transpose': 6, 'all_reduce_scalars_per_step': 1}, 'nnx_jit_state': {'copy': 12}}
    found = {f.name: f.text for f in advice.findings(fake_result(slow, programs))}
    assert '2.20 ms of its 3.10 ms dispatch' in found['graph_walk']
    assert "6 transposes, pmap's 0" in found['transposes'] and 'all-reduces 1 scalar' in found['loss_per_step']
    assert 'donates 0 of its 10 state arrays' in found['donation'] and '12 copies' in found['donation']
    fast = {'legacy': 1.0, 'nnx': 0.5, 'nnx_jit_state': 0.9, 'nnx_jit_dict': 0.9}
    found = {f.name for f in advice.findings(fake_result(fast, {}))}
    assert found == {'summary'}  # nothing slower, no transposes, no loss per step, no copies saved
    one_device = {'nnx': {'transpose': 6, 'all_reduce_operands_per_step': 0}}  # more transposes, nothing all-reduced
    assert 'transposes' not in {f.name for f in advice.findings(fake_result(slow, one_device))}


def test_a_step_of_seconds_prints_its_steps_per_second_not_zero():
    """ViT-S on the CPU runs about 0.4 steps/s: the table and the advice printed '0 [0, 1]' and '(0 against 0)'."""
    result = fake_result(dict.fromkeys(['legacy', 'nnx', 'nnx_jit_state', 'nnx_jit_dict'], 1.0), {})
    for name in result.blocks:
        result.blocks[name] = [Block(0.377, 1.0, 5300.0, 3500.0, 0)] * 2
    assert benchreport.rate(0.377) == '0.38' and benchreport.rate(1355.2) == '1355'
    assert '(0.38 against 0.38)' in {f.name: f.text for f in advice.findings(result)}['summary']


def test_memory_ratio_is_to_the_data_parallel_call_at_the_same_k():
    result = fake_result(dict.fromkeys(['legacy', 'nnx', 'nnx_jit_state', 'nnx_jit_dict'], 1.0), {})
    result.compiles['legacy'].hlo.update(argument_bytes=250, temp_bytes=1000)
    assert benchreport.memory_cells(result, result.variants[0]).split()[-1] == '0.25/2.00'
    result.variants[0].steps_per_call = 1  # another K: no ratio
    assert len(benchreport.memory_cells(result, result.variants[0]).split()) == 2
