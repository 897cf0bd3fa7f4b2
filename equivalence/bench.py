"""``python -m equivalence.bench``: legacy pmap(scan) and the NNX variants, timed side by side.

Fused steps/s (median, min, max over interleaved repeats), one step per call, compile
time, host dispatch time per call, what XLA built, and PASS/FAIL against the targets.
A benchmark, not a test: exit 0 whatever the timings, 2 on bad input.
"""

import dataclasses
import sys
import warnings

from equivalence import cli, devices

K_SCALING = 20  # the fused K that the "fusing pays" target compares with one step per call
K_COMPILE = (5, 100)  # compile time must not grow with K: the scan stays a loop


def parse(argv: list[str] | None):
    from equivalence.workloads import WORKLOADS

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
    parser.add_argument('--json', default=None, metavar='PATH', help='write the results as JSON')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing --json file')
    return parser.parse_args(argv)


def make_config(args, n_available: int):
    """Flags -> RunConfig (``calls`` = calls per timed block); bad input exits 2 with one line."""
    for flag, value in (('--repeats', args.repeats), ('--compile-repeats', args.compile_repeats)):
        if value < 1:
            cli.fail(f'{flag} must be at least 1, got {value}')
    return cli.run_config(args, n_available)


def main(argv: list[str] | None = None) -> int:
    devices.simulate_cpu_devices()  # before anything imports jax
    args = parse(argv)
    cli.check_output_path(args.json, args.overwrite)
    import jax

    from equivalence import benchreport, report

    wl, config = make_config(args, len(jax.devices()))
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
    result = run(wl, config, args.repeats, args.compile_repeats)
    print(benchreport.text(result))
    if args.json:
        report.write_json(args.json, benchreport.to_json(result))
    return 0


def run(wl, config, repeats: int, compile_repeats: int):
    """Build every variant, check they agree, time compiles, warm up, then the interleaved repeats."""
    from equivalence import benchreport, measure, variants

    progress = measure.Progress(f'{config.workload} D={config.devices} K={config.steps_per_call}')
    machine = measure.machine()
    progress('building variants')
    pool_steps = config.calls * max(config.steps_per_call, K_SCALING, *K_COMPILE)
    feed = variants.Feed(wl, config, pool_steps)
    built = variants.build_all(wl, config, feed, K_SCALING)
    compiles = {}
    for v in built:
        progress(f'compile x{compile_repeats}: {v.label}')
        compiles[v.name] = measure.time_compile(v, v.steps_per_call, compile_repeats)
    scaling = compile_scaling(next(v for v in built if v.name == 'nnx'), compile_repeats, progress)
    first = {}
    for v in built:
        progress(f'first call and warm-up: {v.label}')
        first[v.name] = v.host_losses(v.call(v.place(1)[0]))
        measure.warm_up(v, 3)
    blocks = measure.interleaved(built, repeats, config.calls, progress)
    progress.done()
    machine['load_avg_1m_end'] = measure.machine()['load_avg_1m']
    return benchreport.BenchResult(config, repeats, machine, built, blocks, compiles, scaling, first)


def compile_scaling(v, repeats: int, progress) -> dict[int, 'object']:
    """The shipped call compiled at K=5 and K=100, alternately."""
    from equivalence import measure

    timings = {k: measure.CompileTiming([], {}) for k in K_COMPILE}
    for r in range(repeats):
        for k in K_COMPILE:
            progress(f'compile scaling {r + 1}/{repeats}: nnx shipped at K={k}')
            one = measure.time_compile(v, k, 1)
            timings[k] = dataclasses.replace(timings[k], seconds=timings[k].seconds + one.seconds, hlo=one.hlo)
    return timings


if __name__ == '__main__':
    sys.exit(main())
