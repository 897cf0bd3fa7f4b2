"""``python -m equivalence.bench --cost``: what a check costs against the two runs it checks.

Each repeat runs, in fresh processes (``cost_process``: nothing compiled before, JAX's persistent
compilation cache off), the port's two *bare* runs (the pmap side and the new side, each built,
compiled once and run for the same K and C, in one process, as a team's own training runs them), its
check (``harness.run``, as ``python -m equivalence.run`` runs it) and, with ``--slip``, the check of a
slipped port, whose MISMATCH is diagnosed and located. The order rotates every repeat (A B C, B C A,
...), so that a drift of the machine's load falls on all of them alike. Reported: each one's wall
seconds, median [min, max]; the ratio check / bare of medians (what the targets read), beside the
median [min, max] of the per-repeat ratios (each check against the bare runs of its own repeat) and the
ratio of their CPU seconds (every thread's: what the check does more, which others' load changes least); each
stage's median seconds; and whether every repeat computed the same losses (bare and check alike).
"""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = 'equivalence.bench.cost_process'
TARGETS = {'match': 1.25, 'mismatch': 2.0}  # a check's wall at most this many times the bare runs'
TIMEOUT_S = 3600  # one repeat: a large port's first MISMATCH on a loaded machine
OFF = {'EQUIVALENCE_COMPILATION_CACHE': '0', 'JAX_ENABLE_COMPILATION_CACHE': 'false'}


class RepeatFailed(RuntimeError):
    """A repeat's process failed: its last line (``port``: in the port or its flags, as ``run`` says: exit 2)."""

    def __init__(self, line: str, port: bool):
        super().__init__(line)
        self.port = port


@dataclasses.dataclass(frozen=True)
class Subject:
    """What one kind of repeat runs: ``mode`` (``bare`` or ``check``) of the port loaded by ``spec``."""

    name: str  # 'bare', 'match', 'mismatch'
    label: str
    mode: str
    spec: str
    config: object  # RunConfig


PLATFORMS = 'EQUIVALENCE_COST_PLATFORMS'  # the JAX_PLATFORMS the repeats' processes run with (the user's)


def leave_the_accelerator() -> None:
    """This process on JAX's CPU backend: one program at a time can hold a TPU chip (libtpu's lock), and a
    GPU's first process takes 75% of its memory, so a parent that opened the accelerator to count its devices
    left none to the repeats it starts (a TPU v5e: 'Internal error when accessing libtpu multi-process
    lockfile', exit 3). The repeats get the user's platforms back (``env``) and check the device count
    themselves (a count the accelerator lacks is their one-line error, exit 2)."""
    os.environ.setdefault(PLATFORMS, os.environ.get('JAX_PLATFORMS', ''))
    os.environ['JAX_PLATFORMS'] = 'cpu'
    if 'jax' in sys.modules:  # imported, its backend not yet started (the flags are parsed before it)
        sys.modules['jax'].config.update('jax_platforms', 'cpu')


def env() -> dict[str, str]:
    """This process's environment (its device count, its import path: the port's folder on it), with
    every persistent compilation cache off: each repeat compiles afresh; the user's JAX platforms."""
    environ = {k: v for k, v in os.environ.items() if k not in ('JAX_COMPILATION_CACHE_DIR', 'JAX_PLATFORMS')}
    if os.environ.get(PLATFORMS):
        environ['JAX_PLATFORMS'] = os.environ[PLATFORMS]
    path = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p and os.path.isdir(p))
    return {**environ, **OFF, 'PYTHONPATH': path}


def one(subject: Subject) -> dict:
    """One repeat of ``subject`` in a fresh process: its JSON line, and ``process_s`` (its whole life)."""
    fields = {f.name: getattr(subject.config, f.name) for f in dataclasses.fields(subject.config)}
    command = [sys.executable, '-m', CHILD, subject.mode, subject.spec, json.dumps(fields)]
    began = time.perf_counter()
    proc = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    spent = time.perf_counter() - began
    record = _record(proc.stdout)  # the child's JSON line: what it measured, or why it failed
    if proc.returncode != 0 or record is None or 'failed' in record:
        if record is not None and 'failed' in record:
            why = record['failed']
        else:  # it died before it could say (a signal, an abort): its last words are all there is
            why = (proc.stderr.strip().splitlines() or [f'exit {proc.returncode}'])[-1]
        raise RepeatFailed(f'{subject.label} ({subject.spec}) failed in its process: {why}', proc.returncode == 2)
    return {**record, 'process_s': spent}


def _record(stdout: str) -> dict | None:
    """The last line a repeat's process printed, as the JSON record it writes; None where there is none."""
    lines = stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]) if lines else None
    except ValueError:
        return None


def measure(subjects: list[Subject], repeats: int, progress) -> dict[str, list[dict]]:
    """Every subject once per repeat, the order rotating by one each repeat."""
    runs: dict[str, list[dict]] = {s.name: [] for s in subjects}
    for r in range(repeats):
        shift = r % len(subjects)
        for s in subjects[shift:] + subjects[:shift]:
            progress(f'repeat {r + 1}/{repeats}: {s.label}')
            runs[s.name].append(one(s))
    return runs


def _stats(values: list[float]) -> dict:
    return {'median': statistics.median(values), 'min': min(values), 'max': max(values), 'values': values}


def _stages(repeats: list[dict]) -> list[dict]:
    """Each stage's median wall and compile seconds and programs over the repeats (by name, in order)."""
    names: dict[tuple, list[dict]] = {}
    for rep in repeats:
        for st in rep['timing']['stages']:
            names.setdefault((st['name'], st['depth']), []).append(st)
    med = lambda xs, key: statistics.median(x[key] for x in xs)  # noqa: E731
    return [{'name': n, 'depth': d, 'wall_s': med(xs, 'wall_s'), 'compile_s': med(xs, 'compile_s'),
             'programs': med(xs, 'programs'), 'repeats': len(xs)} for (n, d), xs in names.items()]  # fmt: skip


def _memory(repeats: list[dict]) -> dict:
    """The peaks each repeat's process measured (``peaks``): the host's resident bytes, and the most any
    device held (None where the backend counts none: the CPU's)."""
    got = [r['timing'].get('memory') or {} for r in repeats]
    hosts = [m['host_peak_bytes'] for m in got if m.get('host_peak_bytes')]
    devices = [max(m['device_peak_bytes'].values()) for m in got if m.get('device_peak_bytes')]
    return {'host_peak_bytes': _stats(hosts) if hosts else None,
            'device_peak_bytes': _stats(devices) if devices else None}  # fmt: skip


def summary(subjects: list[Subject], runs: dict[str, list[dict]], machine: dict) -> dict:
    """The JSON of a cost run: every repeat's figures, their medians, the ratios and the targets."""
    bare = runs['bare']
    out = {'mode': 'cost', 'repeats': len(bare), 'machine': machine, 'method': __doc__.split('\n\n', 1)[1].strip(),
           'subjects': {}, 'targets': []}  # fmt: skip
    for s in subjects:
        reps = runs[s.name]
        walls = [r['wall_s'] for r in reps]
        one_ = {
            'label': s.label, 'workload': s.spec, 'config': {'devices': s.config.devices,
            'steps_per_call': s.config.steps_per_call, 'calls': s.config.calls, 'batch_size': s.config.batch_size,
            'seed': s.config.seed, 'rng': s.config.rng_mode, 'strategy': s.config.strategy},
            'wall_s': _stats(walls), 'process_s': _stats([r['process_s'] for r in reps]),
            'cpu_s': _stats([r['cpu_s'] for r in reps]),
            'compile_s': _stats([r['timing']['compile_s'] for r in reps]),
            'programs': _stats([r['timing']['programs'] for r in reps]),
            'compiled_again': reps[0]['timing'].get('compiled_again', {}),
            'stages': _stages(reps),
            **_memory(reps),
            'same_losses_every_repeat': all(r['losses'] == reps[0]['losses'] for r in reps),
        }  # fmt: skip
        if s.mode == 'check':
            per = [r['wall_s'] / b['wall_s'] for r, b in zip(reps, bare, strict=True)]
            ratio = statistics.median(walls) / statistics.median(r['wall_s'] for r in bare)
            cpu = statistics.median(r['cpu_s'] for r in reps) / statistics.median(r['cpu_s'] for r in bare)
            said = {(r['outcome'], r['diagnosis_kind'], r['diagnosis'], r['where']) for r in reps}
            one_.update(ratio_vs_bare=ratio, ratio_per_repeat=_stats(per), cpu_ratio_vs_bare=cpu,
                        outcome=reps[0]['outcome'], diagnosis_kind=reps[0]['diagnosis_kind'],
                        diagnosis=reps[0]['diagnosis'],
                        where=reps[0]['where'], same_verdict_every_repeat=len(said) == 1)  # fmt: skip
            expected = {'match': 'MATCH', 'mismatch': 'MISMATCH'}[s.name]
            out['targets'].append({'name': f'{s.label} / bare runs', 'value': ratio, 'op': '<=',
                                   'threshold': TARGETS[s.name], 'pass': ratio <= TARGETS[s.name],
                                   'outcome_expected': expected, 'outcome': reps[0]['outcome']})  # fmt: skip
        out['subjects'][s.name] = one_
    match = runs.get('match')
    if match:  # the check computed the numbers the bare runs computed: it changed none
        out['check_losses_are_the_bare_runs'] = all(r['losses'] == bare[0]['losses'] for r in match)
    return out


def _range(st: dict, fmt: str = '.1f') -> str:
    return f'{st["median"]:{fmt}} [{st["min"]:{fmt}}, {st["max"]:{fmt}}]'


def text(result: dict) -> str:
    """The cost table, the targets and where each run's time went."""
    m, subjects = result['machine'], result['subjects']
    first = next(iter(subjects.values()))
    c = first['config']
    lines = [
        f'cost of a check: {first["workload"]} on {c["devices"]} device(s), K={c["steps_per_call"]} x C={c["calls"]}, '
        f'global batch {c["batch_size"]}, {result["repeats"]} interleaved repeats, each in a fresh process, '
        'persistent compilation cache off',
        f'machine: {m["cpu_cores_usable"]} of {m["cpu_cores"]} CPU cores ({m["cpu_model"]}), {m["backend"]}, '
        f'load avg {m["load_avg_1m"]:.1f} -> {m.get("load_avg_1m_end", m["load_avg_1m"]):.1f}; '
        + ', '.join(f'{k} {v}' for k, v in m['versions'].items()),
        'wall = the work in its process (after imports and loading the port, which every run shares); '
        "ratio = median check wall / median bare wall; CPU s = the same work's CPU seconds (every thread), "
        'what a loaded machine changes least',
        '',
        f'{"run":44s} {"wall s median [min, max]":>26s} {"vs bare":>8s} {"per repeat":>20s} '
        f'{"CPU s (vs bare)":>16s} {"compile s":>10s} {"programs":>9s} {"host GB":>8s} {"device GB":>9s}  outcome',
    ]
    gb = lambda st: f'{st["median"] / 1e9:.2f}' if st else '-'  # noqa: E731
    for s in subjects.values():
        ratio = f'{s["ratio_vs_bare"]:.2f}x' if 'ratio_vs_bare' in s else '1.00x'
        per = _range(s['ratio_per_repeat'], '.2f') if 'ratio_per_repeat' in s else ''
        cpu = f'{s["cpu_s"]["median"]:.1f} ({s.get("cpu_ratio_vs_bare", 1.0):.2f}x)'
        lines.append(f'{s["label"][:44]:44s} {_range(s["wall_s"]):>26s} {ratio:>8s} {per:>20s} {cpu:>16s} '
                     f'{s["compile_s"]["median"]:>10.1f} {s["programs"]["median"]:>9.0f} '
                     f'{gb(s.get("host_peak_bytes")):>8s} {gb(s.get("device_peak_bytes")):>9s}  '
                     f'{s.get("outcome", "")}')  # fmt: skip
    for s in subjects.values():
        if s.get('outcome') == 'MISMATCH':
            lines += ['', f'{s["label"]}: {s["diagnosis"] or "(no diagnosis)"}', f'  {s["where"] or "where: (none)"}']
    lines += ['', 'targets (ratio of medians):']
    for t in result['targets']:
        ok = 'PASS' if t['pass'] and t['outcome'] == t['outcome_expected'] else 'FAIL'
        wrong = (
            '' if t['outcome'] == t['outcome_expected'] else f' (outcome {t["outcome"]}, not {t["outcome_expected"]})'
        )
        lines.append(f'  {ok}  {t["name"]}: {t["value"]:.2f}x (target <= {t["threshold"]:.2f}x){wrong}')
    same = all(s['same_losses_every_repeat'] for s in subjects.values())
    lines.append(f'  {"PASS" if same else "FAIL"}  every repeat computed the same losses (each run against its own)')
    if 'check_losses_are_the_bare_runs' in result:
        ok = result['check_losses_are_the_bare_runs']
        lines.append(f'  {"PASS" if ok else "FAIL"}  the check computed the losses the bare runs computed')
    for s in subjects.values():
        lines += ['', f'stages of {s["label"]} (median wall s, compile s, programs):']
        for st in (st for st in s['stages'] if st['depth'] <= 1):
            name = f'{"  " * st["depth"]}{st["name"]}'[:72]
            lines.append(f'  {name:72s} {st["wall_s"]:7.1f} {st["compile_s"]:7.1f} {st["programs"]:5.0f}')
        again = ', '.join(f'{name} x{n}' for name, n in s['compiled_again'].items())
        lines.append(f'  programs compiled more than once (first repeat): {again or "none"}')
    lines += ['', 'absolute numbers on shared CPUs are noisy; the ratios are what count']
    return '\n'.join(lines)


def run(spec: str, config, slip: tuple[str, object] | None, repeats: int) -> dict:
    """Bare runs, the check and (``slip``: ``(spec, config)``) the slipped port's check, ``repeats`` times."""
    from equivalence.bench import timing

    subjects = [Subject('bare', 'bare runs (pmap side + new side)', 'bare', spec, config),
                Subject('match', 'check', 'check', spec, config)]  # fmt: skip
    if slip is not None:
        subjects.append(Subject('mismatch', f'check of the slip {slip[0]}', 'check', *slip))
    progress = timing.Progress(f'cost {spec} D={config.devices} K={config.steps_per_call} C={config.calls}')
    machine = timing.machine()
    runs = measure(subjects, repeats, progress)
    progress.done()
    machine['load_avg_1m_end'] = timing.machine()['load_avg_1m']
    return summary(subjects, runs, machine)
