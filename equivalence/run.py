"""``python -m equivalence.run``: both paths, same seed and data; exit 0 when they match."""

import sys
import warnings

from equivalence import cli, distributed
from equivalence.checkpoint import options as checkpoint_options

EXIT_CODES = cli.exit_codes(
    'every leaf and loss matches',
    'a leaf or loss is outside tolerance (MISMATCH)',
    unverified='NOT VERIFIED: every leaf is within its floor, but more than 10% of the parameters, the output\n'
    '     layer or the losses are noise-dominated: a slip there would pass unseen; or no twin could\n'
    "     measure the port's noise floor, and the fixed screen would have decided (docs/verdict.md)",
)


def parse(argv: list[str] | None):
    from equivalence.core.port.workloads import WORKLOADS

    parser = cli.OneLineParser(prog='python -m equivalence.run', description=__doc__, epilog=EXIT_CODES)
    cli.add_run_flags(parser, list(WORKLOADS))
    parser.add_argument('--nnx-form', default='split', help='split: jax.jit(lax.scan); graph: nnx.jit(nnx.scan)')
    parser.add_argument(
        '--perturb',
        type=float,
        default=0.0,
        metavar='REL',
        help='NNX lr * (1+REL), -1 < REL <= 1000: a deliberate mismatch',
    )
    parser.add_argument(
        '--verdict',
        default='measured',
        help='measured: every leaf against the noise floor of twin runs (default; the pmap side gets its own '
        "twin only when the NNX one fails after a first step that agrees); strict: and the first step's "
        'gradients always; screen: a fixed tolerance, the twins only when it fails',
    )
    parser.add_argument(
        '--precision',
        default='auto',
        help="float32 matrix products' precision: auto (default): highest on an accelerator, where the default "
        'rounds them to bfloat16 passes (TPU) or TF32 (GPU) and no floor measures that; highest; default: the '
        "backend's own",
    )
    parser.add_argument(
        '--default-gap',
        action='store_true',
        help="on an accelerator checked at highest: both sides run once more at the backend's default precision, "
        'and how far apart they end is said, not judged (about a third more time: not run unless asked)',
    )
    parser.add_argument(
        '--twin',
        default='program',
        help="what measures the noise floor: program (default): the run's own compiled program again, on the "
        'same devices, its initial parameters and batches moved by one float32 spacing; devices: the new side '
        'again on other device counts (a second compile, more bytes per device, maybe a fresh process)',
    )
    parser.add_argument(
        '--locate',
        action='store_true',
        help='say where the first step parts (module, loss, gradient, statistic, optimizer slot) on MATCH too; '
        'a MISMATCH always says it (one more first step on each side)',
    )
    parser.add_argument(
        '--reference',
        default=None,
        metavar='FILE',
        help='read the pmap side from FILE, recorded once by python -m equivalence.record, and run only the new '
        'side (the pmap code need not be importable; docs/record.md); --devices, --steps-per-call, --calls, '
        '--batch-size, --seed and --rng not given are the ones it was recorded with',
    )
    parser.add_argument(
        '--verbose',
        '-v',
        action='store_true',
        help='the whole report: every leaf beside its floor, each twin and probe, each figure behind where:, every '
        'stage (the default prints the first screen: the outcome, what differs, where, how sure, the cost)',
    )
    cli.add_output_flags(parser, 'write a machine-readable report', plot=True)
    distributed.add_flags(parser)
    checkpoint_options.add_flags(parser)
    return cli.parse(parser, argv)


def inputs(argv: list[str] | None, n_available: int | None = None):
    """Every flag parsed and checked, nothing run: ``(args, workload, RunConfig, CheckpointOptions)``;
    raises ``ConfigError``."""
    args = parse(argv)
    extra = {'perturb': args.perturb, 'nnx_form': args.nnx_form, 'verdict': args.verdict}
    extra |= {'twin': args.twin, 'precision': args.precision, 'default_gap': args.default_gap}
    extra['locate'] = args.locate or None
    extra['reference'] = args.reference
    wl, config = cli.run_config(args, n_available, **extra)
    checkpoints = checkpoint_options.from_args(args)
    if args.reference is not None and (checkpoints.requested or args.processes > 1):
        raise cli.ConfigError('--reference runs the new side alone, in one process: it takes no --resume-at, '
                              '--checkpoint-dir or --processes')  # fmt: skip
    checkpoints.check(config, several=args.processes > 1 or distributed.worker.is_worker(args))
    return args, wl, config, checkpoints


def progress(total: int):
    """``(bar, tick, say)``: each stage on stderr as it begins and ends, terminal or not (``clock.Lines``);
    on a terminal, a tqdm bar over the compiled calls too, naming the stage that runs; a worker of
    several processes logs one line per call as well."""
    from equivalence.core.measure import clock

    bar, say = clock.on_stderr(total, 'call', 'compiled calls')
    if bar is None:
        return None, (distributed.progress_log(total) if distributed.several() else None), say
    return bar, lambda path: (bar.set_postfix_str(path, refresh=False), bar.update()), say


def work(validated) -> int:
    import jax

    from equivalence.core import harness
    from equivalence.core.report import output, render

    args, wl, config, checkpoints = validated
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
    bar, tick, say = progress(checkpoints.calls_to_run(config))
    if checkpoints.requested:  # legacy saves; with --resume-at, NNX resumes from the migrated checkpoint
        from equivalence.checkpoint import resume

        result = resume.run(wl, config, checkpoints, progress=tick, say=say)
    else:
        result = harness.run(wl, config, progress=tick, say=say)
    if bar is not None:
        bar.close()
    print(render.text(result, jax.default_backend(), verbose=args.verbose))
    if not distributed.reports():  # several processes: process 0 writes the files
        return result.outcome.exit_code
    if args.json is not None:
        output.write_json(args.json, render.to_json(result, render.versions()), overwrite=args.overwrite)
    if args.plot is not None:
        from equivalence.core.report import plots

        print('wrote ' + ', '.join(plots.write(result, args.plot)))
    return result.outcome.exit_code  # 0 MATCH, 1 MISMATCH, 5 NOT VERIFIED (verdict.outcome)


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch('equivalence.run', inputs, work, argv)


if __name__ == '__main__':
    sys.exit(main())
