"""``python -m equivalence.bench``: legacy pmap(scan) and the NNX variants, timed side by side.

Fused steps/s (median, min, max over interleaved repeats), one step per call, compile
time, host dispatch time per call, what XLA built, and PASS/FAIL against the targets.
A benchmark, not a test: a FAIL is reported, not an exit code.
"""

import sys
import warnings

from equivalence import cli, distributed

EXIT_CODES = cli.exit_codes('measured, whatever the timings')
MAX_REPEATS = 1_000  # more is a soak test, not a benchmark


def parse(argv: list[str] | None):
    from equivalence.core.port.workloads import WORKLOADS

    parser = cli.OneLineParser(prog='python -m equivalence.bench', description=__doc__, epilog=EXIT_CODES)
    strategies = 'also time the NNX call under these: S[,S...] or all (default: dp only)'
    cli.add_run_flags(parser, list(WORKLOADS), 'calls per variant in one repeat (default 20)', 20, strategies)
    parser.add_argument('--nnx-form', default='split', help='form of the --strategy variants: split or graph')
    parser.add_argument('--repeats', type=int, default=10, help='R interleaved repeats of every variant (default 10)')
    parser.add_argument('--compile-repeats', type=int, default=3, help='fresh compiles timed per variant (default 3)')
    cli.add_output_flags(parser, 'write the results as JSON')
    distributed.add_flags(parser)
    return cli.parse(parser, argv)


def inputs(argv: list[str] | None, n_available: int | None = None):
    """Every flag parsed and checked, nothing timed: ``(args, workload, RunConfig, strategy configs)``;
    raises ``ConfigError``. ``RunConfig.calls`` is the calls per timed block; the config is the
    data-parallel base of the default variants, and ``--strategy`` adds one config each."""
    import argparse
    import dataclasses

    from equivalence import bench
    from equivalence.core import harness
    from equivalence.core.port.config import STRATEGIES, ConfigError, check_count, parse_mesh

    args = parse(argv)
    check_count('--repeats', args.repeats, MAX_REPEATS)
    check_count('--compile-repeats', args.compile_repeats, MAX_REPEATS)
    base = argparse.Namespace(**{**vars(args), 'strategy': 'dp', 'mesh': None})
    wl, config = cli.run_config(base, n_available, data_k=bench.POOL_K)
    strategies = list(STRATEGIES) if args.strategy == 'all' else args.strategy.split(',')
    mesh = parse_mesh(args.mesh) if args.mesh is not None else None
    if mesh and 'fsdp-tp' not in strategies:
        raise ConfigError('--mesh shapes the fsdp-tp mesh; add fsdp-tp to --strategy')
    extra = [
        dataclasses.replace(config, strategy=s, mesh=mesh if s == 'fsdp-tp' else None, nnx_form=args.nnx_form)
        for s in strategies
        if (s, args.nnx_form) != ('dp', 'split')  # the default variants are dp in split form
    ]
    for cfg in extra:
        harness.validate(wl, cfg)
    return args, wl, config, extra


def work(validated) -> int:
    from equivalence import bench
    from equivalence.bench import report as benchreport
    from equivalence.core.report import output

    args, wl, config, strategy_configs = validated
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
    result = bench.run(wl, config, args.repeats, args.compile_repeats, strategy_configs)
    print(benchreport.text(result))
    if args.json is not None and distributed.reports():
        output.write_json(args.json, benchreport.to_json(result), overwrite=args.overwrite)
    return cli.EXIT_MATCH


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch('equivalence.bench', inputs, work, argv)


if __name__ == '__main__':
    sys.exit(main())
