"""The benchmark's table, targets and JSON: ratios against legacy pmap(scan) are what count."""

import statistics
import textwrap

from equivalence.bench import advice
from equivalence.bench.result import BenchResult, rate  # noqa: F401 -- BenchResult: part of this module's API
from equivalence.bench.timing import stats
from equivalence.bench.variants import Variant

METHOD = {
    'inputs': 'keys and batches are placed on the devices before each timed block (not timed, for every variant)',
    'timed_call': 'dispatch = until the call returns; call = until its losses are ready; one call in flight; '
    'cpu = process CPU time per call, all threads',
    'order': 'warm-up, then every variant once per repeat (A B C ... A B C ...)',
    'compile': 'trace + lower + XLA compile of a fresh build (new step closures), timed per repeat',
}


def _target(name: str, value: float, op: str, threshold: float, per_repeat: list[float], applies: bool = True):
    """One target: ``value`` (a ratio of medians) decides; the per-repeat ratios show the noise around it."""
    ok = value >= threshold if op == '>=' else value <= threshold
    return {
        'name': name,
        'value': value,
        'op': op,
        'threshold': threshold,
        'pass': bool(ok),
        'applies': applies,
        'per_repeat': {**stats(per_repeat), 'values': per_repeat},
    }


def targets(r: BenchResult) -> list[dict]:
    """Every target whose variants ran (a loop port has no bare ``jax.jit`` twin of its call)."""
    k_scaling = r.k_scaling
    fused_k = 'nnx' if r.config.steps_per_call == k_scaling else f'nnx_k{k_scaling}'
    k5, k100 = r.scaling.values()
    compile_ratio = statistics.median(k100.seconds) / statistics.median(k5.seconds)
    out = [
        _target(
            'fused steps/s: nnx shipped / legacy pmap(scan)',
            r.median('nnx') / r.median('legacy'),
            '>=',
            1.0,
            r.paired('nnx', 'legacy'),
        )
    ]
    if any(v.name == 'jit_bare' for v in r.variants):
        out.append(
            _target(
                'host dispatch per fused call: nnx shipped / bare jax.jit',
                r.median('nnx', 'dispatch_ms') / r.median('jit_bare', 'dispatch_ms'),
                '<=',
                1.05,
                r.paired('nnx', 'jit_bare', 'dispatch_ms'),
            )
        )
    return out + [
        _target(
            f'steps/s: nnx shipped K={k_scaling} / K=1 (target defined on mlp)',
            r.median(fused_k) / r.median('nnx_k1'),
            '>=',
            3.0,
            r.paired(fused_k, 'nnx_k1'),
            applies=r.config.workload == 'mlp',
        ),
        _target(
            'compile time: nnx shipped K=100 / K=5',
            compile_ratio,
            '<=',
            1.2,
            [a / b for a, b in zip(k100.seconds, k5.seconds, strict=True)],
        ),
    ]


def header(r: BenchResult) -> list[str]:
    c, m = r.config, r.machine
    sim = ' (simulated)' if m['backend'] == 'cpu' and m['simulated_cpu_devices'] else ''
    v = m['versions']
    lines = [
        f'{c.workload}: {c.devices} {m["backend"]} device(s){sim}, K={c.steps_per_call} steps per fused call, '
        f'global batch {c.batch_size}, rng {c.rng_mode}, {r.repeats} repeats x {c.calls} calls per variant',
        f'machine: {m["cpu_cores_usable"]} of {m["cpu_cores"]} CPU cores ({m["cpu_model"]}), {m["device_kind"]}, '
        f'load avg {m["load_avg_1m"]:.1f} -> {m["load_avg_1m_end"]:.1f}; python {v["python"]}, jax {v["jax"]}, '
        f'jaxlib {v["jaxlib"]}, flax {v["flax"]}, optax {v["optax"]}, numpy {v["numpy"]}',
        f'method: {METHOD["inputs"]}; {METHOD["timed_call"]}',
    ]
    return [wrapped for line in lines for wrapped in textwrap.wrap(line, 118, subsequent_indent='  ')]


def variant_rows(r: BenchResult) -> list[str]:
    """Two tables of one row per variant, each under 120 characters: speed, then compile, memory, agreement."""
    speed = [f'{"variant":<40} {"K":>3}  {"steps/s median [min, max]":>27}  {"vs legacy, same K":>18}  '
             f'{"dispatch":>8}  {"call ms":>8}  {"cpu ms":>7}']  # fmt: skip
    other = [f'{"variant":<40} {"compile s":>9}  {"args B/dev":>10}  {"temp B/dev":>10}  {"vs dp":>9}  '
             'first call vs legacy']  # fmt: skip
    for v in r.variants:
        s, base, agree = stats(r.steps(v.name)), r.baseline(v), r.agreement(v)
        apart = agree.max_abs('losses')
        check = ('same' if apart == 0 else f'{apart:.1e}') + ('' if r.agrees(v) else ' NO')
        recompiled = sum(b.compiles for b in r.blocks[v.name])
        ms = [r.median(v.name, f) for f in ('dispatch_ms', 'call_ms', 'cpu_ms')]
        speed.append(
            f'{v.label[:40]:<40} {v.steps_per_call:>3}  {rate(s["median"]):>9} '
            f'[{rate(s["min"]):>7}, {rate(s["max"]):>7}]  '
            f'{r.median(v.name) / r.median(base):>6.2f}x {base[:11]:<11}  {ms[0]:>8.3f}  {ms[1]:>8.3f}  {ms[2]:>7.2f}'
            + (f'  ({recompiled} recompiles while timed!)' if recompiled else '')
        )
        compile_s = statistics.median(r.compiles[v.name].seconds)
        other.append(f'{v.label[:40]:<40} {compile_s:>9.2f}  {memory_cells(r, v)}  {check}')
    return [*speed, '', *other]


def memory_cells(r: BenchResult, v: Variant) -> str:
    """Arguments and temporaries per device (``memory_analysis`` of the compiled call), and their
    ratio to the data-parallel shipped call's at the same K (FSDP's and TP's saving, pmap's cost)."""
    hlo = r.compiles[v.name].hlo
    dp = next((u for u in r.variants if u.name == 'nnx'), None)
    ratio = ''
    if dp is not None and dp.steps_per_call == v.steps_per_call:
        base = r.compiles['nnx'].hlo
        ratio = '/'.join(f'{hlo[f] / base[f]:.2f}' if base[f] else '-' for f in ('argument_bytes', 'temp_bytes'))
    return f'{hlo["argument_bytes"]:>10}  {hlo["temp_bytes"]:>10}  {ratio:>9}'


HLO_COLUMNS = {  # summary field -> column header
    'all_reduce': 'all-reduce',
    'all_reduce_operands_per_step': 'ops/step',
    'all_reduce_operands_per_call': 'ops/call',
    'all_reduce_bytes': 'reduced B',
    'copy': 'copy',
    'transpose': 'transpose',
    'while': 'while',
    'fusion': 'fusion',
    'aliased_bytes': 'donated B',
    'all_reduce_scalars_per_step': 'loss/step',
}  # memory per device (argument_bytes, temp_bytes) is in the timing table, beside speed


def hlo_rows(r: BenchResult) -> list[str]:
    """The compiled programs' counts, in two tables of half the columns each (under 120 characters)."""
    rows = textwrap.wrap(
        'compiled programs (instructions in the HLO text; ops/step = all-reduced arrays in the scan body, '
        'ops/call = outside it; on CPU each is one rendezvous of all devices):',
        118,
    )
    programs = [(v.label, r.compiles[v.name].hlo) for v in r.variants]
    programs += [(f'nnx shipped, K={k} (compile scaling)', t.hlo) for k, t in r.scaling.items()]
    columns = list(HLO_COLUMNS)
    for half in (columns[:5], columns[5:]):
        rows.append(f'  {"variant":<40}' + ''.join(f'{HLO_COLUMNS[c]:>11}' for c in half))
        rows += [f'  {label[:40]:<40}' + ''.join(f'{summary[c]:>11}' for c in half) for label, summary in programs]
    return rows


def target_rows(r: BenchResult) -> list[str]:
    rows = ['targets (value = ratio of medians; per repeat = median [min, max] of the paired per-repeat ratios):']
    for t in targets(r):
        verdict = ('PASS' if t['pass'] else 'FAIL') if t['applies'] else 'n/a '
        p = t['per_repeat']
        rows.append(
            f'  {verdict}  {t["name"]}: {t["value"]:.2f}x (target {t["op"]} {t["threshold"]:.2f}x); '
            f'per repeat {p["median"]:.2f} [{p["min"]:.2f}, {p["max"]:.2f}]'
        )
    return rows


def placement_rows(r: BenchResult) -> list[str]:
    """Where the NNX calls' gradient all-reduce fell back to the partitioner's placement, and why."""
    return [f'note on the NNX calls: {n}' for n in r.placement]


def text(r: BenchResult) -> str:
    note = 'absolute numbers on shared CPUs are noisy; the ratios are what count'
    tips = advice.rows(r)
    body = [*header(r), *placement_rows(r), '', *variant_rows(r), '', *hlo_rows(r), '', *target_rows(r), '', *tips]
    body += [''] * bool(tips)
    return '\n'.join([*body, note])


def to_json(r: BenchResult) -> dict:
    c = r.config
    return {
        'workload': c.workload,
        'devices': c.devices,
        'steps_per_call': c.steps_per_call,
        'calls_per_repeat': c.calls,
        'repeats': r.repeats,
        'batch_size': c.batch_size,
        'seed': c.seed,
        'rng_mode': c.rng_mode,
        'machine': r.machine,
        'method': METHOD,
        'variants': {v.name: variant_json(r, v) for v in r.variants},
        'compile_scaling': {
            f'k{k}': {'compile_s': {**stats(t.seconds), 'per_repeat': t.seconds}, 'hlo': t.hlo}
            for k, t in r.scaling.items()
        },
        'targets': targets(r),
        'advice': [f.to_json() for f in advice.findings(r)],
        'not_derived': r.notes,
        'gradient_placement': r.placement,
    }


def variant_json(r: BenchResult, v: Variant) -> dict:
    blocks, base, agree = r.blocks[v.name], r.baseline(v), r.agreement(v)
    return {
        'label': v.label,
        'steps_per_call': v.steps_per_call,
        'steps_per_s': {**stats(r.steps(v.name)), 'per_repeat': r.steps(v.name)},
        'baseline': base,
        'ratio_vs_baseline': r.median(v.name) / r.median(base),
        'dispatch_ms': stats([b.dispatch_ms for b in blocks]),
        'call_ms': stats([b.call_ms for b in blocks]),
        'cpu_ms': stats([b.cpu_ms for b in blocks]),
        'compile_s': {**stats(r.compiles[v.name].seconds), 'per_repeat': r.compiles[v.name].seconds},
        'hlo': r.compiles[v.name].hlo,
        'compiles_while_timed': sum(b.compiles for b in blocks),
        'facts': v.facts,
        'first_call': {
            'max_abs_diff_vs_legacy': agree.max_abs('losses'),
            'agrees': r.agrees(v),
            'losses': r.first[v.name].tolist(),
        },
    }
