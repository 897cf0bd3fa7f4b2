"""``python -m equivalence.record``: the pmap side of a check, run once and written to a reference file that
``python -m equivalence.run --reference FILE`` checks the new side against, anywhere, after the pmap code is gone
(docs/record.md). Exit 0 when written; 2 on bad input (an existing file is replaced only with --overwrite)."""

import shlex
import sys
import warnings

from equivalence import cli

EXIT_CODES = cli.exit_codes('the reference is written', None, workers=False)
# What JAX says of any pmap-era step and not of this port (messages, as ``warnings.filterwarnings`` reads them):
# the batch donated as score_sde did, and jax 0.4's jit-of-pmap, which the recorder's own programs are.
QUIET = ('Some donated buffers were not usable', 'The jitted function .* includes a pmap')


def parse(argv: list[str] | None):
    from equivalence.core.port.workloads import WORKLOADS

    parser = cli.OneLineParser(prog='python -m equivalence.record', description=__doc__, epilog=EXIT_CODES)
    cli.add_run_flags(parser, list(WORKLOADS), placement=False)  # --strategy, --mesh: the new side's, never run
    parser.add_argument('--out', required=True, metavar='FILE', help='the reference to write (.npz)')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing reference')
    return cli.parse(parser, argv)


def inputs(argv: list[str] | None, n_available: int | None = None):
    """Every flag parsed and checked, nothing run: ``(args, workload, RunConfig)``; raises ``ConfigError``."""
    from equivalence import compat

    compat.install()  # the pmap side's modules on the JAX the pmap code ran on (jax 0.4.38 and up)
    from equivalence.core.report import output

    args = parse(argv)
    output.check_file(args.out, args.overwrite, flag='--out')
    wl, config = cli.run_config(args, n_available, recording=True)
    return args, wl, config


def work(validated) -> int:
    from equivalence.core import harness
    from equivalence.core.measure import clock

    args, wl, config = validated
    quiet()
    done = harness.record(wl, config, args.out, say=clock.Lines(sys.stderr))
    steps = config.steps_per_call * config.calls
    print(f'wrote {args.out}: the pmap side of {wl.name!r}, {steps} steps on {config.devices} devices, '
          f'last loss {float(done["losses"][-1]):.6g}')  # fmt: skip
    print(f'check a port against it: {check_command(args.workload, args.out)} (its devices, steps, batch, seed and '
          'keys are read from the reference)')  # fmt: skip
    return 0


def check_command(workload: str, out: str) -> str:
    """The command that checks a port against the reference at ``out``: ``run`` reads every flag that decides
    what the pmap side computed from it (a ``--rng`` said here was wrong for a port handed no key)."""
    return f'python -m equivalence.run --workload {shlex.quote(workload)} --reference {shlex.quote(out)}'


def quiet() -> None:
    """JAX's warnings about the recorder's own programs, not the port (``QUIET``), left unsaid."""
    for message in QUIET:
        warnings.filterwarnings('ignore', message=message)


def main(argv: list[str] | None = None) -> int:
    return cli.main(inputs, work, argv)


if __name__ == '__main__':
    sys.exit(main())
