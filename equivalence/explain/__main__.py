"""``python -m equivalence.explain``: what XLA compiled for one fused call of each path.

Nothing is trained: each path's fused call is lowered and compiled once, then read
(see the ``equivalence.explain`` package for what is measured and how).
Exit codes: 0 explained, 2 bad input, 4 a worker of several processes died or could not join.
"""

import sys
import warnings

from equivalence import cli, devices, distributed
from equivalence.explain import answers_text, draw, header_text, measure_both, path_text, report, strategy_text


def parse(argv: list[str] | None):
    from equivalence.core.workloads import WORKLOADS

    parser = cli.OneLineParser(prog='python -m equivalence.explain', description=__doc__)
    cli.add_run_flags(parser, list(WORKLOADS))
    parser.add_argument('--json', default=None, metavar='PATH', help='write the same content as JSON')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing --json file')
    distributed.add_flags(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    devices.simulate_cpu_devices()  # before anything imports jax
    args = parse(argv)
    check = lambda: cli.check_output_path(args.json, args.overwrite)
    return distributed.command('equivalence.explain', argv, args, check, lambda: explain(args))


def explain(args) -> int:
    """Both paths' compiled calls, read and printed (process 0's view, with several processes)."""
    import jax

    from equivalence.core import report as report_io

    wl, config = cli.run_config(args, len(jax.devices()))  # as run: bad input exits 2 with one line
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
    legacy, nnx = measure_both(wl, config)
    r = report(legacy, nnx, config, jax.default_backend(), report_io.versions())
    print(header_text(r))
    for m in (legacy, nnx):
        print('\n' + path_text(r['paths'][m.path]))
        draw(m)
    print(answers_text(r))
    print(strategy_text(r))
    if args.json and distributed.reports():
        report_io.write_json(args.json, r)
    return cli.EXIT_MATCH


if __name__ == '__main__':
    sys.exit(main())
