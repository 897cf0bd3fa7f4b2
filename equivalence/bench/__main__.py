"""``python -m equivalence.bench``: legacy pmap(scan) and the NNX variants, timed side by side.

Fused steps/s (median, min, max over interleaved repeats), one step per call, compile
time, host dispatch time per call, what XLA built, and PASS/FAIL against the targets.
A benchmark, not a test: a FAIL is reported, not an exit code.
"""

import sys
import warnings

from equivalence import cli

EXIT_CODES = cli.exit_codes('measured, whatever the timings')
MAX_REPEATS = 1_000  # more is a soak test, not a benchmark


def parse(argv: list[str] | None):
    from equivalence.core.workloads import WORKLOADS

    parser = cli.OneLineParser(prog='python -m equivalence.bench', description=__doc__, epilog=EXIT_CODES)
    cli.add_run_flags(parser, list(WORKLOADS), 'calls per variant in one repeat (default 20)', calls_default=20)
    parser.add_argument('--repeats', type=int, default=10, help='R interleaved repeats of every variant (default 10)')
    parser.add_argument('--compile-repeats', type=int, default=3, help='fresh compiles timed per variant (default 3)')
    cli.add_output_flags(parser, 'write the results as JSON')
    return cli.parse(parser, argv)


def inputs(argv: list[str] | None, n_available: int | None = None):
    """Every flag parsed and checked, nothing timed: ``(args, workload, RunConfig)``; raises ``ConfigError``.

    ``RunConfig.calls`` is the calls per timed block.
    """
    from equivalence import bench
    from equivalence.core.config import check_count

    args = parse(argv)
    check_count('--repeats', args.repeats, MAX_REPEATS)
    check_count('--compile-repeats', args.compile_repeats, MAX_REPEATS)
    wl, config = cli.run_config(args, n_available, data_k=bench.POOL_K)
    return args, wl, config


def work(validated) -> int:
    from equivalence import bench
    from equivalence.bench import report as benchreport
    from equivalence.core import output

    args, wl, config = validated
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
    result = bench.run(wl, config, args.repeats, args.compile_repeats)
    print(benchreport.text(result))
    if args.json is not None:
        output.write_json(args.json, benchreport.to_json(result))
    return cli.EXIT_MATCH


def main(argv: list[str] | None = None) -> int:
    return cli.main(inputs, work, argv)


if __name__ == '__main__':
    sys.exit(main())
