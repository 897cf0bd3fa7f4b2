"""``python -m equivalence.checkpoint migrate LEGACY_DIR NNX_DIR``: a pmap-era checkpoint -> an NNX one;
``python -m equivalence.checkpoint verify NNX_DIR [LEGACY_DIR]``: every file and leaf against its sha256.

migrate writes nothing unless every legacy leaf has an NNX place (or the port's ``skip=`` names
it), never writes where it reads, keeps an existing NNX_DIR unless --force, and writes a sha256
per leaf and per file beside the checkpoint; verify hashes every file of the NNX step, re-reads
both checkpoints, and names the first file or leaf whose bytes changed since (Orbax keeps no
checksum of its own).
"""

import sys

from equivalence import cli

EXIT_CODES = cli.exit_codes('written (migrate), or every leaf matches its sha256 (verify)', workers=False)


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
    verify = commands.add_parser(
        'verify', help='check a migrated checkpoint against the sha256 migrate wrote', epilog=EXIT_CODES
    )
    verify.add_argument('nnx_dir', metavar='NNX_DIR', help='a checkpoint written by migrate')
    verify.add_argument(
        'legacy_dir',
        metavar='LEGACY_DIR',
        nargs='?',
        default=None,
        help='and its legacy source (default: the one the manifest records, relative to NNX_DIR)',
    )
    verify.add_argument('--step', type=int, default=None, help='the step to check (default: the latest complete)')
    return parser.parse_args(argv)


def inputs(argv: list[str] | None, n_available: int | None = None):
    """Every flag parsed and (migrate) the workload loaded, nothing read or written: ``(args, port)``;
    raises ``ConfigError``. The directories are checked by the command itself."""
    from equivalence.core.port import workloads

    args = parse(argv)
    return args, workloads.get(args.workload) if args.command == 'migrate' else None


def work(validated) -> int:
    from equivalence.checkpoint import manifest, migrate, store
    from equivalence.core.port.config import ConfigError

    args, port = validated
    if args.command == 'verify':
        with store.quiet():
            lines = manifest.verify(args.nnx_dir, args.legacy_dir, args.step, find_legacy=True)
        print('\n'.join(lines))
        return cli.EXIT_MATCH
    try:
        with store.quiet():
            result = migrate.migrate(args.legacy_dir, args.nnx_dir, port, step=args.step, force=args.force)
    except migrate.MigrationError as e:
        print('\n'.join(e.migration.lines()))
        raise ConfigError(str(e)) from None
    print('\n'.join(result.lines()))
    return cli.EXIT_MATCH


def main(argv: list[str] | None = None) -> int:
    return cli.main(inputs, work, argv)


if __name__ == '__main__':
    sys.exit(main())
