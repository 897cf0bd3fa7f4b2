"""``python -m equivalence.corpus``: the verdict corpus, run; the confusion matrix of truth x verdict,
one row per entry, and the sensitivity of the verdict to a slipped learning rate."""

import sys
import warnings

from equivalence import cli
from equivalence.core.port.config import TWINS, ConfigError, check_available, check_count

EXIT_CODES = cli.exit_codes(
    'zero wrong verdicts: every correct port MATCHed, every slip MISMATCHed (with the right kind, where named)',
    'some verdict is wrong',
    workers=False,
)
DEFAULT_SEEDS, QUICK_SENSITIVITY_SEEDS, SENSITIVITY_SEEDS = 3, 3, 10


def parse(argv: list[str] | None):
    parser = cli.OneLineParser(prog='python -m equivalence.corpus', description=__doc__, epilog=EXIT_CODES)
    parser.add_argument('--list', action='store_true', help='list the entries and exit')
    parser.add_argument('--only', default=None, metavar='NAME[,NAME]', help='run these entries (default: all)')
    parser.add_argument('--devices', default='1,2,4,8', metavar='D[,D]', help='device counts (default 1,2,4,8)')
    parser.add_argument('--seeds', type=int, default=None, help=f'seeds per entry (default {DEFAULT_SEEDS}; cnn 10)')
    parser.add_argument('--quick', action='store_true', help='the quick entries, one seed, sensitivity over 3 seeds')
    parser.add_argument(
        '--sensitivity-seeds',
        type=int,
        default=None,
        metavar='N',
        help='seeds of the --perturb ladder (default 10; 0 skips)',
    )
    parser.add_argument(
        '--twin',
        default='program',
        help="what measures each run's floor, as run's --twin: program (default) or devices (calibration: the two)",
    )
    cli.add_output_flags(parser, 'write every run and the sensitivity as JSON')
    return cli.parse(parser, argv)


def device_list(text: str, available: int) -> tuple[int, ...]:
    """``'1,2,4,8'`` -> ``(1, 2, 4, 8)``, each a count JAX can give; ``ConfigError`` otherwise."""
    parts = text.split(',')
    if not all(part.strip().isdigit() for part in parts):
        raise ConfigError(f'--devices must be counts separated by commas, e.g. 1,2,4,8, got {text!r}')
    counts = tuple(int(part) for part in parts)
    for d in counts:
        check_count('--devices', d)
        check_available(d, available)
    return counts


def inputs(argv: list[str] | None, n_available: int | None = None):
    """Every flag parsed and checked, nothing run: ``(args, entries, devices, seeds, sensitivity seeds)``."""
    from equivalence import corpus

    args = parse(argv)
    names = args.only.split(',') if args.only else None
    try:
        entries = corpus.select(names, args.quick)
    except KeyError as e:
        raise ConfigError(f'unknown corpus entry {e.args[0]!r}; see --list') from None
    if args.twin not in TWINS:
        raise ConfigError(f'--twin must be one of {", ".join(TWINS)}, got {args.twin!r}')
    if args.list:
        return args, entries, (), 0, 0
    available = cli.available_devices(n_available)
    counts = device_list(args.devices, available)
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else DEFAULT_SEEDS)
    check_count('--seeds', seeds)
    sens = args.sensitivity_seeds
    sens = sens if sens is not None else (QUICK_SENSITIVITY_SEEDS if args.quick else SENSITIVITY_SEEDS)
    if sens < 0:
        raise ConfigError(f'--sensitivity-seeds must be 0 (skip) or more, got {sens}')
    if sens and available < 8:
        raise ConfigError(f'the sensitivity runs mlp at D=8, JAX sees {available} devices; set JAX_NUM_CPU_DEVICES=8')
    return args, entries, counts, seeds, sens


def progress(case, ladder: bool = False) -> None:
    """One line per run on stderr; WRONG marks a wrong verdict (a ladder level below the sensitivity is none)."""
    kind = f' {case.kind}' if case.kind else ''
    margin = f', worst leaf at {case.x_limit:.2g} of its limit' if case.x_limit is not None else ''
    line = f'{case.entry} D={case.devices} seed {case.seed}: {case.verdict}{kind}{margin} ({case.seconds:.1f} s)'
    wrong = case.wrong and not (ladder and case.truth == 'slip')
    print(line + (f'  WRONG: {case.detail}' if wrong else ''), file=sys.stderr)


def work(validated) -> int:
    import jax

    from equivalence.core.report import output
    from equivalence.corpus import runner, sensitivity, table

    args, entries, counts, seeds, sens = validated
    if args.list:
        for e in entries:
            print(f'{e.name:<18} {e.truth:<8} {e.kind or "-":<10} {"quick " if e.quick else "      "}{e.what}')
        return cli.EXIT_MATCH
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
    cases = runner.run(entries, counts, seeds, progress, twin=args.twin)
    s = sensitivity.measure(sens, lambda case: progress(case, ladder=True), twin=args.twin) if sens else None
    print(table.text(entries, cases, s, jax.default_backend()))
    if args.json is not None:
        output.write_json(args.json, table.to_json(cases, s), overwrite=args.overwrite)
    return cli.EXIT_MATCH if not table.wrong_cases(cases, s) else cli.EXIT_MISMATCH


def main(argv: list[str] | None = None) -> int:
    return cli.main(inputs, work, argv)


if __name__ == '__main__':
    sys.exit(main())
