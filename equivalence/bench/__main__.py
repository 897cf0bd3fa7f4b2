"""``python -m equivalence.bench``: legacy pmap(scan) and the NNX variants, timed side by side.

Fused steps/s (median, min, max over interleaved repeats), one step per call, compile
time, host dispatch time per call, what XLA built, and PASS/FAIL against the targets.
With --cost: what a whole check costs against the two bare runs it checks (the pmap side and
the new side, each compiled once), each repeat in fresh processes, a --slip's MISMATCH too.
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
    calls = "calls per variant in one repeat (default 20); with --cost the check's C calls (default 4, as run)"
    cli.add_run_flags(parser, list(WORKLOADS), calls, None, strategies)
    parser.add_argument('--nnx-form', default='split', help='form of the --strategy variants: split or graph')
    parser.add_argument('--repeats', type=int, default=None,
                        help='R interleaved repeats of every variant (default 10; with --cost 3)')  # fmt: skip
    parser.add_argument(
        '--cost',
        action='store_true',
        help="time the port's check against its two bare runs (the pmap side and the new side, "
        'each compiled once), each repeat in fresh processes with the compilation cache off',
    )
    parser.add_argument(
        '--slip',
        default=None,
        metavar='NAME',
        help='with --cost: a slipped port (package.module:NAME) whose MISMATCH is timed too',
    )
    parser.add_argument('--compile-repeats', type=int, default=3, help='fresh compiles timed per variant (default 3)')
    parser.add_argument('--k-scaling', type=int, default=None, metavar='K',
                        help='the long fused K timed beside --steps-per-call and one step per call (default 20; '
                        '--steps-per-call itself times none beside them, for a step of seconds)')  # fmt: skip
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
    if args.cost:
        from equivalence.bench import cost

        cost.leave_the_accelerator()  # this process only checks the flags and starts the repeats' processes
        return cost_inputs(args, n_available)
    if args.slip is not None:
        raise ConfigError('--slip names the MISMATCH that --cost times; add --cost')
    args.calls = 20 if args.calls is None else args.calls
    args.repeats = 10 if args.repeats is None else args.repeats
    check_count('--repeats', args.repeats, MAX_REPEATS)
    check_count('--compile-repeats', args.compile_repeats, MAX_REPEATS)
    args.k_scaling = bench.K_SCALING if args.k_scaling is None else args.k_scaling
    check_count('--k-scaling', args.k_scaling, bench.POOL_K)
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


def cost_inputs(args, n_available: int | None):
    """``--cost``'s flags checked: ``(args, spec, RunConfig, (slip spec, its RunConfig) or None)``."""
    import argparse

    from equivalence.core.port.config import ConfigError, check_count

    if args.processes != 1:
        raise ConfigError('--cost runs each repeat as one process of its own; --processes does not apply')
    if ',' in args.strategy or args.strategy == 'all':
        raise ConfigError(f'--cost checks one placement, as run does: --strategy S, got {args.strategy!r}')
    args.calls = 4 if args.calls is None else args.calls
    args.repeats = 3 if args.repeats is None else args.repeats
    check_count('--repeats', args.repeats, MAX_REPEATS)
    _, config = cli.run_config(args, n_available)
    slip = None
    if args.slip is not None:
        _, slip_config = cli.run_config(argparse.Namespace(**{**vars(args), 'workload': args.slip}), n_available)
        slip = (args.slip, slip_config)
    return args, args.workload, config, slip


def work(validated) -> int:
    from equivalence import bench
    from equivalence.bench import report as benchreport
    from equivalence.core.report import output

    if validated[0].cost:
        return cost_work(validated)
    args, wl, config, strategy_configs = validated
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
    result = bench.run(wl, config, args.repeats, args.compile_repeats, strategy_configs, args.k_scaling)
    print(benchreport.text(result))
    if args.json is not None and distributed.reports():
        output.write_json(args.json, benchreport.to_json(result), overwrite=args.overwrite)
    return cli.EXIT_MATCH


def cost_work(validated) -> int:
    from equivalence.bench import cost
    from equivalence.core.report import output

    args, spec, config, slip = validated
    try:
        result = cost.run(spec, config, slip, args.repeats)
    except cost.RepeatFailed as e:
        if not e.port:
            raise
        from equivalence.core.port.config import ConfigError

        raise ConfigError(str(e)) from None  # the port's own mistake, said in one line (exit 2)
    print(cost.text(result))
    if args.json is not None:
        output.write_json(args.json, result, overwrite=args.overwrite)
    return cli.EXIT_MATCH


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch('equivalence.bench', inputs, work, argv)


if __name__ == '__main__':
    sys.exit(main())
