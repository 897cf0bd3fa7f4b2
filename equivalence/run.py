"""``python -m equivalence.run``: both paths, same seed and data; exit 0 when they match.

Exit codes: 0 everything matches, 1 a leaf or loss is outside tolerance, 2 bad input,
4 a worker of several processes died or could not join.
"""

import os
import sys
import warnings

from equivalence import cli, devices, distributed
from equivalence.checkpoint import options as checkpoint_options


def parse(argv: list[str] | None):
    from equivalence.core.workloads import WORKLOADS

    parser = cli.OneLineParser(prog='python -m equivalence.run', description=__doc__)
    cli.add_run_flags(parser, list(WORKLOADS))
    parser.add_argument('--nnx-form', default='split', help='split: jax.jit(lax.scan); graph: nnx.jit(nnx.scan)')
    parser.add_argument('--perturb', type=float, default=0.0, help='NNX lr * (1+REL): a deliberate mismatch')
    parser.add_argument('--json', default=None, metavar='PATH', help='write a machine-readable report')
    parser.add_argument('--plot', default=None, metavar='DIR', help='write losses.png and divergence.png into DIR')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing --json file or --plot figures')
    distributed.add_flags(parser)
    checkpoint_options.add_flags(parser)
    return parser.parse_args(argv)


def check_plot_dir(directory: str | None, overwrite: bool) -> None:
    """Before any work: DIR is a directory we can create or use, and holds no figure we would replace."""
    if directory is None:
        return
    from equivalence.core import plots

    if os.path.exists(directory) and not os.path.isdir(directory):
        cli.fail(f'--plot {directory} is not a directory')
    if plots.existing(directory) and not overwrite:
        cli.fail(f'{", ".join(plots.existing(directory))} exists; pass --overwrite to replace it')
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        cli.fail(f'cannot create --plot directory {directory}: {e.strerror}')


def progress_bar(total: int):
    """A tqdm bar on stderr, shown only on a terminal and only once a run has taken 3 s; a worker
    of several processes logs one line per call instead."""
    if not sys.stderr.isatty():
        return None, (distributed.progress_log(total) if distributed.several() else None)
    from tqdm import tqdm

    bar = tqdm(total=total, unit='call', desc='compiled calls', file=sys.stderr, delay=3.0, leave=False)
    return bar, lambda path: (bar.set_postfix_str(path, refresh=False), bar.update())


def main(argv: list[str] | None = None) -> int:
    devices.simulate_cpu_devices()  # before anything imports jax
    args = parse(argv)
    return distributed.command('equivalence.run', argv, args, lambda: check_outputs(args), lambda: run(args))


def check_outputs(args) -> None:
    cli.check_output_path(args.json, args.overwrite)
    check_plot_dir(args.plot, args.overwrite)


def run(args) -> int:
    """Both paths, the report on stdout (process 0's, with several), the files; the exit code."""
    import jax

    from equivalence.core import harness, report
    from equivalence.core.config import ConfigError

    wl, config = cli.run_config(args, len(jax.devices()), perturb=args.perturb, nnx_form=args.nnx_form)
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
    checkpoints = checkpoint_options.from_args(args)
    bar, tick = progress_bar(checkpoints.calls_to_run(config))
    try:
        if checkpoints.requested:  # legacy saves; with --resume-at, NNX resumes from the migrated checkpoint
            from equivalence.checkpoint import resume

            result = resume.run(wl, config, checkpoints, progress=tick)
        else:
            result = harness.run(wl, config, progress=tick)
    except ConfigError as e:  # a port whose sides do not pair: found before any training
        cli.fail(str(e))
    if bar is not None:
        bar.close()
    print(report.text(result, jax.default_backend()))
    if args.json and distributed.reports():
        report.write_json(args.json, report.to_json(result, report.versions()))
    if args.plot and distributed.reports():
        from equivalence.core import plots

        print('wrote ' + ', '.join(plots.write(result, args.plot)))
    return cli.EXIT_MATCH if result.report.match else cli.EXIT_MISMATCH


if __name__ == '__main__':
    sys.exit(main())
