"""``python -m equivalence.checkpoint migrate LEGACY_DIR NNX_DIR``: a pmap-era checkpoint -> an NNX one.

Nothing mapped wrongly is ever written: a leaf without a place, an existing NNX_DIR (unless
--force) or a damaged checkpoint is bad input, named in one line.
"""

import sys

from equivalence import cli

EXIT_CODES = cli.exit_codes('migrated: the NNX checkpoint is written', workers=False)


def parse(argv: list[str] | None):
    parser = cli.OneLineParser(prog='python -m equivalence.checkpoint', description=__doc__, epilog=EXIT_CODES)
    commands = parser.add_subparsers(dest='command', required=True, parser_class=cli.OneLineParser)
    migrate = commands.add_parser(
        'migrate', help='convert a legacy (linen, pmap) checkpoint into an NNX one', epilog=EXIT_CODES
    )
    migrate.add_argument('legacy_dir', metavar='LEGACY_DIR', help='an Orbax directory of legacy train states')
    migrate.add_argument('nnx_dir', metavar='NNX_DIR', help='where the NNX train state checkpoint is written')
    migrate.add_argument('--workload', default='mlp', help='a built-in workload, or your port as module:NAME')
    migrate.add_argument('--step', type=int, default=None, help='the step to convert (default: the latest complete)')
    migrate.add_argument('--force', action='store_true', help='replace an existing NNX_DIR')
    return parser.parse_args(argv)


def inputs(argv: list[str] | None, n_available: int | None = None):
    """Every flag parsed and the workload loaded, nothing read or written: ``(args, port)``;
    raises ``ConfigError``. The directories are checked by the migration itself."""
    from equivalence.core import workloads

    args = parse(argv)
    return args, workloads.get(args.workload)


def work(validated) -> int:
    from equivalence.checkpoint import migrate, store

    args, port = validated
    try:
        with store.quiet():
            result = migrate.migrate(args.legacy_dir, args.nnx_dir, port, step=args.step, force=args.force)
    except migrate.MigrationError as e:
        print('\n'.join(e.migration.lines()))
        cli.fail(str(e))
    print('\n'.join(result.lines()))
    return cli.EXIT_MATCH


def main(argv: list[str] | None = None) -> int:
    return cli.main(inputs, work, argv)


if __name__ == '__main__':
    sys.exit(main())
