"""What every ``python -m equivalence.<cmd>`` shares: flags, one-line errors, exit codes.

Nothing here imports JAX: the device count must be requested before JAX starts.
"""

import argparse
import os
import sys

EXIT_MATCH, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2
EXIT_WORKER_DIED = 4  # several processes: a worker died or could not join (equivalence.distributed)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit 2, no usage dump."""

    def error(self, message: str):
        fail(f'{message} (see --help)')


def fail(message: str):
    print(f'error: {message}', file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def add_run_flags(parser: argparse.ArgumentParser, workloads: list[str]) -> None:
    parser.add_argument('--workload', default='mlp', help=f'one of: {", ".join(workloads)} (default mlp)')
    parser.add_argument('--devices', type=int, default=None, help='D devices (default: all; 8 simulated on CPU)')
    parser.add_argument('--steps-per-call', type=int, default=5, help='K steps fused per call (default 5)')
    parser.add_argument('--calls', type=int, default=4, help='C compiled calls (default 4)')
    parser.add_argument('--batch-size', type=int, default=None, help="global batch (default: the workload's)")
    parser.add_argument('--seed', type=int, default=0, help='seed of data, initial parameters and keys')
    parser.add_argument('--rng', default='per-device', help='per-device (score_sde) or global (default per-device)')
    parser.add_argument('--strategy', default='dp', help='NNX placement: dp, fsdp, tp, fsdp-tp, shard_map (default dp)')
    parser.add_argument('--mesh', default=None, help="fsdp-tp's 2-D mesh, data=A,model=B (default data=D/2,model=2)")


def check_output_path(path: str | None, overwrite: bool) -> None:
    """Fail before any work if a report would clobber a file or cannot be written."""
    if path is None:
        return
    if os.path.exists(path) and not overwrite:
        fail(f'{path} exists; pass --overwrite to replace it')
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        fail(f'cannot write {path}: directory {parent} does not exist')


def check_processes(config, n_available: int) -> None:
    """With several processes, pmap and the mesh span every device of every process."""
    import jax

    from equivalence.core.config import ConfigError

    if jax.process_count() > 1 and config.devices != n_available:
        raise ConfigError(
            f'--devices {config.devices}: a run of {jax.process_count()} processes uses all their {n_available} devices'
        )


def run_config(args: argparse.Namespace, n_available: int, **extra):
    """The flags of ``add_run_flags`` -> ``(workload, RunConfig)``; bad input exits 2 with one line."""
    from equivalence.core import workloads
    from equivalence.core.config import ConfigError, RunConfig, check_available, parse_mesh

    try:
        wl = workloads.get(args.workload)
        config = RunConfig(
            workload=wl.name,
            devices=args.devices or n_available,
            steps_per_call=args.steps_per_call,
            calls=args.calls,
            batch_size=args.batch_size or wl.default_batch,
            seed=args.seed,
            rng_mode=args.rng,
            strategy=args.strategy,
            mesh=parse_mesh(args.mesh) if args.mesh else None,
            **extra,
        )
        check_available(config, n_available)
        check_processes(config, n_available)
    except ConfigError as e:
        fail(str(e))
    return wl, config
