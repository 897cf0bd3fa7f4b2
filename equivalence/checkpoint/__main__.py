"""``python -m equivalence.checkpoint migrate LEGACY_DIR NNX_DIR``: a pmap-era checkpoint -> an NNX one.

Exit codes: 0 written; 2 bad input (one line: nothing mapped wrongly is ever written, an
existing NNX_DIR is kept unless --force, a damaged checkpoint is named).
"""

import sys

from equivalence import cli, devices


def parse(argv: list[str] | None):
    parser = cli.OneLineParser(prog='python -m equivalence.checkpoint', description=__doc__)
    commands = parser.add_subparsers(dest='command', required=True, parser_class=cli.OneLineParser)
    migrate = commands.add_parser('migrate', help='convert a legacy (linen, pmap) checkpoint into an NNX one')
    migrate.add_argument('legacy_dir', metavar='LEGACY_DIR', help='an Orbax directory of legacy train states')
    migrate.add_argument('nnx_dir', metavar='NNX_DIR', help='where the NNX train state checkpoint is written')
    migrate.add_argument('--workload', default='mlp', help='a built-in workload or a port, package.module:NAME')
    migrate.add_argument('--step', type=int, default=None, help='the step to convert (default: the latest complete)')
    migrate.add_argument('--force', action='store_true', help='replace an existing NNX_DIR')
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    devices.simulate_cpu_devices()  # before anything imports jax
    args = parse(argv)
    from equivalence.checkpoint import migrate, store
    from equivalence.core import workloads
    from equivalence.core.config import ConfigError

    try:
        with store.quiet():
            result = migrate.migrate(
                args.legacy_dir, args.nnx_dir, workloads.get(args.workload), step=args.step, force=args.force
            )
    except migrate.MigrationError as e:
        print('\n'.join(e.migration.lines()))
        cli.fail(str(e))
    except ConfigError as e:
        cli.fail(str(e))
    print('\n'.join(result.lines()))
    return cli.EXIT_MATCH


if __name__ == '__main__':
    sys.exit(main())
