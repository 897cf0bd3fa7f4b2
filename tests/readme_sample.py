"""The README's sample reports, held to real runs so that they cannot rot.

A block of README.md marked ``<!-- sample report: python -m equivalence.run ARGS -->`` is what that command
prints. ``test_cli`` runs each command once (its MATCH and MISMATCH tests) and hands the output to
``assert_sample``, which compares it with the block line by line: every figure and every leaf path masked (the
float32 sums differ between CPUs, and so may the leaves a table ranks first), runs of spaces made one, and a
block line ``...`` standing for any number of report lines. A change of wording, or of the lines' order, fails.

After the report changes, write the blocks again from this checkout's runs (the compilation cache off, as in
a first check): ``python tests/readme_sample.py --write`` (without ``--write`` it prints them).
"""

import os
import re
import subprocess
import sys
from functools import cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
COMMAND = 'python -m equivalence.run'
MARKER = re.compile(r'<!--\s*sample report:\s*python -m equivalence\.run\s*(.*?)\s*-->')
ELIDED = '...'
LEAF = re.compile(r'\b\w+(?:/\w+)+\b')  # params/hidden/bias, out/kernel
FIGURE = re.compile(r'[-+]?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?')  # 2.254299402, 2.38e-07, 1,500, 20
CACHED = re.compile(r', \d+ from the compilation cache')  # a second check, where the cache is on
LOSS_ROW = re.compile(r'\s*\d+\s+-?\d')  # a row of the per-step loss table
SHOWN = {'loss': 2, 'leaf': 3}  # the rows a written block keeps of each table (and the loss table's last)


def mask(line: str) -> str:
    line = CACHED.sub('', line)
    return ' '.join(FIGURE.sub('#', LEAF.sub('<leaf>', line)).split())


def report_lines(stdout: str) -> list[str]:
    """What the command printed as its report: without the ``wrote ...`` line that ``--plot`` adds."""
    lines = stdout.rstrip('\n').splitlines()
    return lines[:-1] if lines and lines[-1].startswith('wrote ') else lines


def samples(text: str | None = None) -> dict[str, list[str]]:
    """``{ARGS: the block's lines}`` for every sample block of the README."""
    lines = (text if text is not None else _read()).splitlines()
    return {args: lines[start:end] for args, start, end in _blocks(lines)}


def _blocks(lines: list[str]) -> list[tuple[str, int, int]]:
    """``(ARGS, first line, end)`` of each sample block's text, the fences left out."""
    found = []
    for i, line in enumerate(lines[:-1]):
        if (m := MARKER.fullmatch(line.strip())) and lines[i + 1].startswith('```'):
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith('```'))
            found.append((m.group(1), i + 2, end))
    return found


def _read() -> str:
    with open(README, encoding='utf-8') as f:
        return f.read()


def fits(block: list[str], report: list[str]) -> bool:
    """Whether the report is the block, figures and leaves masked, ``...`` matching any run of lines."""
    want, got = [mask(x) for x in block], [mask(x) for x in report]

    @cache
    def from_(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(got)
        if want[i] == ELIDED:
            return any(from_(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and want[i] == got[j] and from_(i + 1, j + 1)

    return from_(0, 0)


def first_difference(block: list[str], report: list[str]) -> str:
    """The first block line that the report, read in order, does not hold (masked), for the failure message."""
    got, j = [mask(x) for x in report], 0
    for line in block:
        if line == ELIDED:
            continue
        try:
            j = got.index(mask(line), j) + 1
        except ValueError:
            return f'not in the report, in this order: {line!r}'
    return 'the report has lines the block does not (no "..." for them)'


def assert_sample(args: str, stdout: str) -> None:
    block, report = samples()[args], report_lines(stdout)
    regenerate = 'python tests/readme_sample.py --write'
    assert fits(block, report), (
        f"README.md's sample report of `{COMMAND} {args}` is not what it prints: "
        f'{first_difference(block, report)}; if the report changed on purpose: {regenerate}\n' + '\n'.join(report)
    )


SCREEN = (20, 100, 160)  # from the verdict: line to the end, at most 20 lines of at most 100 characters; any line 160
# The JSON's keys two levels deep as the report had them before its first screen was made: it may add keys, never drop
JSON_KEYS = {
    '': ['batch_size', 'calls', 'device', 'devices', 'eval_accuracy', 'leaves', 'losses', 'match', 'max_abs_diff',
         'mesh', 'new_side', 'nnx_form', 'notes', 'outcome', 'param_divergence_per_call', 'perturb', 'placed_by',
         'placement', 'resumed_at', 'rng_mode', 'seed', 'steps', 'steps_per_call', 'strategy', 'timing', 'tolerance',
         'verdict', 'versions', 'workload'],
    'losses': ['legacy', 'new'], 'eval_accuracy': ['legacy', 'new'], 'tolerance': ['atol', 'reason', 'rtol'],
    'max_abs_diff': ['ema', 'losses', 'model_state', 'opt_state', 'params'],
    'verdict': ['diagnosis', 'done', 'errors', 'floor_rule', 'hidden_by_noise', 'kind', 'location', 'memory', 'mode',
                'noise_dominated', 'not_verified', 'sensitivity', 'twin'],
    'timing': ['cached', 'compile_s', 'compiled_again', 'memory', 'programs', 'stages', 'wall_s'],
    'device': ['backend', 'count', 'default_gap', 'default_rounding', 'kind', 'precision'],
    'versions': ['flax', 'jax', 'jaxlib', 'numpy', 'optax', 'python'],
}  # fmt: skip


def assert_first_screen(stdout: str, report: dict) -> None:
    """The default report's first screen fits (``SCREEN``), and its JSON keeps every key it had (``JSON_KEYS``)."""
    lines = report_lines(stdout)
    at = max(i for i, line in enumerate(lines) if line.startswith('verdict: '))
    screen, most, longest = SCREEN
    assert len(lines) - at <= screen and all(len(x) <= most for x in lines[at:]), lines[at:]
    assert all(len(x) <= longest for x in lines), max(lines, key=len)
    missing = [
        f'{g}/{k}' if g else k for g, keys in JSON_KEYS.items() for k in keys if k not in (report[g] if g else report)
    ]
    assert missing == [], missing


def shortened(report: list[str]) -> list[str]:
    """A report as the README shows it: the loss table's first rows and its last, each leaf table's first rows."""
    out, i = [], 0
    while i < len(report):
        if LOSS_ROW.match(report[i]):
            j = _end(report, i, lambda line: LOSS_ROW.match(line))
            rows, keep = report[i:j], SHOWN['loss']
            out += rows if len(rows) <= keep + 1 else [*rows[:keep], ELIDED, rows[-1]]
        elif report[i].startswith('leaf '):  # the leaf table's header: its rows follow, up to a blank line
            j = _end(report, i + 1, str.strip)
            rows, keep = report[i + 1 : j], SHOWN['leaf']
            out += [report[i], *(rows if len(rows) <= keep else [*rows[:keep], ELIDED])]
        else:
            j = i + 1
            out.append(report[i])
        i = j
    return out


def _end(lines: list[str], i: int, holds) -> int:
    while i < len(lines) and holds(lines[i]):
        i += 1
    return i


def run(args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ('JAX_NUM_CPU_DEVICES', 'XLA_FLAGS')}
    env.update(EQUIVALENCE_COMPILATION_CACHE='0', PYTHONPATH=os.pathsep.join([ROOT, env.get('PYTHONPATH', '')]))
    argv = [sys.executable, '-m', 'equivalence.run', *args.split()]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False).stdout


def main(argv: list[str]) -> int:
    lines = _read().splitlines()
    for args, start, end in reversed(_blocks(lines)):  # the last first: the earlier blocks keep their place
        new = shortened(report_lines(run(args)))
        print(f'$ {COMMAND} {args}'.rstrip(), *new, '', sep='\n')
        lines[start:end] = new
    if '--write' in argv:
        with open(README, 'w', encoding='utf-8') as f:
            f.write('\n'.join(lines) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
