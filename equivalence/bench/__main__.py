"""``python -m equivalence.bench``: legacy pmap(scan) and the NNX variants, timed side by side.

Fused steps/s (median, min, max over interleaved repeats), one step per call, compile
time, host dispatch time per call, what XLA built, and PASS/FAIL against the targets.
A benchmark, not a test: exit 0 whatever the timings, 2 on bad input, 4 when a worker of
several processes died or could not join.
"""

import sys
import warnings

from equivalence import cli, devices, distributed


def parse(argv: list[str] | None):
    from equivalence.core.workloads import WORKLOADS

    parser = cli.OneLineParser(prog='python -m equivalence.bench', description=__doc__)
    parser.add_argument('--workload', default='mlp', help=f'one of: {", ".join(WORKLOADS)} (default mlp)')
    parser.add_argument('--devices', type=int, default=None, help='D devices (default: all; 8 simulated on CPU)')
    parser.add_argument('--steps-per-call', type=int, default=5, help='K steps per fused call (default 5)')
    parser.add_argument('--repeats', type=int, default=10, help='R interleaved repeats of every variant (default 10)')
    parser.add_argument('--calls', type=int, default=20, help='calls per variant in one repeat (default 20)')
    parser.add_argument('--compile-repeats', type=int, default=3, help='fresh compiles timed per variant (default 3)')
    parser.add_argument('--batch-size', type=int, default=None, help="global batch (default: the workload's)")
    parser.add_argument('--seed', type=int, default=0, help='seed of data, initial parameters and keys')
    parser.add_argument('--rng', default='per-device', help='per-device (score_sde) or global (default per-device)')
    parser.add_argument('--strategy', default='dp', help='also time the NNX call under these: S[,S...] or all')
    parser.add_argument('--mesh', default=None, help="fsdp-tp's 2-D mesh, data=A,model=B (default data=D/2,model=2)")
    parser.add_argument('--nnx-form', default='split', help='form of the --strategy variants: split or graph')
    parser.add_argument('--json', default=None, metavar='PATH', help='write the results as JSON')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing --json file')
    distributed.add_flags(parser)
    return parser.parse_args(argv)


def make_config(args, n_available: int):
    """Flags -> ``(workload, RunConfig, strategy configs)`` (``calls`` = calls per timed block);
    bad input exits 2 with one line. The config is the data-parallel base of the default
    variants; ``--strategy`` gives one more config each (mesh and form checked up front)."""
    import argparse
    import dataclasses

    from equivalence.core.config import STRATEGIES, ConfigError, parse_mesh

    for flag, value in (('--repeats', args.repeats), ('--compile-repeats', args.compile_repeats)):
        if value < 1:
            cli.fail(f'{flag} must be at least 1, got {value}')
    base = argparse.Namespace(**{**vars(args), 'strategy': 'dp', 'mesh': None})
    wl, config = cli.run_config(base, n_available)
    strategies = list(STRATEGIES) if args.strategy == 'all' else args.strategy.split(',')
    try:
        mesh = parse_mesh(args.mesh) if args.mesh else None
        if mesh and 'fsdp-tp' not in strategies:
            raise ConfigError('--mesh shapes the fsdp-tp mesh; add fsdp-tp to --strategy')
        extra = [
            dataclasses.replace(config, strategy=s, mesh=mesh if s == 'fsdp-tp' else None, nnx_form=args.nnx_form)
            for s in strategies
            if (s, args.nnx_form) != ('dp', 'split')  # the default variants are dp in split form
        ]
    except ConfigError as e:
        cli.fail(str(e))
    return wl, config, extra


def main(argv: list[str] | None = None) -> int:
    devices.simulate_cpu_devices()  # before anything imports jax
    args = parse(argv)
    check = lambda: cli.check_output_path(args.json, args.overwrite)
    return distributed.command('equivalence.bench', argv, args, check, lambda: bench_(args))


def bench_(args) -> int:
    """Every variant timed; the report (process 0's timings, with several processes)."""
    import jax

    from equivalence import bench
    from equivalence.bench import report as benchreport
    from equivalence.core import report

    wl, config, strategy_configs = make_config(args, len(jax.devices()))
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
    result = bench.run(wl, config, args.repeats, args.compile_repeats, strategy_configs)
    print(benchreport.text(result))
    if args.json and distributed.reports():
        report.write_json(args.json, benchreport.to_json(result))
    return 0


if __name__ == '__main__':
    sys.exit(main())
