"""``python -m equivalence.explain``: what XLA compiled for one fused call of each path.

Nothing is trained: each path's fused call is lowered and compiled once, then read
(see the ``equivalence.explain`` package for what is measured and how).
"""

import sys
import warnings

from equivalence import cli, distributed
from equivalence.explain import answers_text, draw, header_text, measure_both, path_text, report, strategy_text

EXIT_CODES = cli.exit_codes('explained')
CALLS_HELP = "C: checked as run's (default 4), but explain compiles one call of K steps whatever C"


def parse(argv: list[str] | None):
    from equivalence.core.port.workloads import WORKLOADS

    parser = cli.OneLineParser(prog='python -m equivalence.explain', description=__doc__, epilog=EXIT_CODES)
    cli.add_run_flags(parser, list(WORKLOADS), calls_help=CALLS_HELP)
    cli.add_output_flags(parser, 'write the same content as JSON')
    distributed.add_flags(parser)
    return cli.parse(parser, argv)


def inputs(argv: list[str] | None, n_available: int | None = None):
    """Every flag parsed and checked, nothing compiled: ``(args, workload, RunConfig)``; raises ``ConfigError``."""
    args = parse(argv)
    wl, config = cli.run_config(args, n_available)
    return args, wl, config


def work(validated) -> int:
    import jax

    from equivalence.core.report import output, render

    args, wl, config = validated
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
    legacy, nnx = measure_both(wl, config)
    r = report(legacy, nnx, config, jax.default_backend(), render.versions())
    print(header_text(r))
    for m in (legacy, nnx):
        print('\n' + path_text(r['paths'][m.path]))
        draw(m)
    print(answers_text(r))
    print(strategy_text(r))
    if args.json is not None and distributed.reports():
        output.write_json(args.json, r, overwrite=args.overwrite)
    return cli.EXIT_MATCH


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch('equivalence.explain', inputs, work, argv)


if __name__ == '__main__':
    sys.exit(main())
