"""``python -m equivalence.pitfalls``: every porting pitfall, wrong version and fix, measured."""

import sys
import time
import traceback
import warnings

from equivalence import cli
from equivalence.core.port.config import ConfigError

MIN_DEVICES = 2  # replicas must be able to disagree
EXIT_CODES = cli.exit_codes(
    'every case behaves as documented: the wrong version shows the damage, the fix matches',
    'some case does not',
    workers=False,  # one process: no worker to die
)


def parse(argv: list[str] | None):
    parser = cli.OneLineParser(prog='python -m equivalence.pitfalls', description=__doc__, epilog=EXIT_CODES)
    parser.add_argument('--list', action='store_true', help='list the cases and exit')
    parser.add_argument('--only', default=None, metavar='NAME', help='run one case')
    cli.add_output_flags(parser, 'write the results as JSON')
    return cli.parse(parser, argv)


def inputs(argv: list[str] | None, n_available: int | None = None):
    """Every flag parsed and checked, nothing run: ``(args, devices)``; raises ``ConfigError``."""
    from equivalence import pitfalls

    args = parse(argv)
    names = pitfalls.names()
    if args.only is not None and args.only not in names:
        raise ConfigError(f'unknown pitfall {args.only!r}; choose one of {", ".join(names)}')
    if args.list:
        return args, None
    n_devices = cli.available_devices(n_available)
    if n_devices < MIN_DEVICES:  # each trap is a difference between devices (a pmean, a key, a split)
        import jax

        backend = jax.default_backend()
        how = 'JAX_NUM_CPU_DEVICES=8' if backend == 'cpu' else 'JAX_PLATFORMS=cpu (8 simulated CPU devices)'
        raise ConfigError(
            f'the pitfalls need at least {MIN_DEVICES} devices, JAX sees {n_devices} {backend} device(s); set {how}'
        )
    return args, n_devices


def run_case(module, n_devices: int) -> dict:
    """One case's row; a case that raises is reported, not fatal, and does not pass."""
    start = time.perf_counter()
    try:
        result = module.run(n_devices)
        row = {'documented': result.documented, **result.__dict__}
    except Exception as e:  # noqa: BLE001 -- one broken case must not hide the others
        from equivalence.pitfalls.base import first_line

        row = {'documented': False, 'symptom': f'case raised {first_line(e)}', 'damage_shown': False,
               'fix_matches': False, 'fix': '', 'traceback': traceback.format_exc()}  # fmt: skip
    header = {'number': module.NUMBER, 'name': module.NAME, 'title': module.TITLE, 'description': module.DESCRIPTION}
    return {**header, **row, 'seconds': round(time.perf_counter() - start, 1)}


def run_cases(names: list[str], n_devices: int) -> list[dict]:
    """Every case's row, each case said on stderr as it runs, piped or not (``pitfall 1 missing_pmean ...
    3.2 s (compiling 2.1 s, 12 programs)``, ``clock.Lines``); on a terminal, a bar over the cases."""
    from equivalence import pitfalls
    from equivalence.core.measure import clock

    bar, say = clock.on_stderr(len(names), 'case', 'pitfalls', depth=0)
    rows = []
    try:
        with clock.measuring(say):
            for name in names:
                module = pitfalls.load(name)
                with clock.stage(f'pitfall {module.NUMBER} {name}'):
                    rows.append(run_case(module, n_devices))
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
    return rows


NO_DAMAGE_OF_ITS_OWN = (
    '+'  # ASCII (a report read on any terminal): the footnote of a wrong version measured to change nothing (case 6)
)


def damage_cell(row: dict) -> str:
    """What was measured: 'yes'; 'none+', the wrong version changes nothing (the trap is what it does
    not do); 'no*', a hazard not forced on this machine; 'no', the damage did not show."""
    if row['damage_shown']:
        return 'yes'
    if row.get('changes_nothing'):
        return 'none' + NO_DAMAGE_OF_ITS_OWN
    return 'no*' if not row.get('damage_required', True) else 'no'


def table(rows: list[dict], n_devices: int, backend: str) -> str:
    lines = [
        f'porting pitfalls on {n_devices} {backend} device(s): wrong version measured, fixed version compared',
        '',
        f'{"#":>2}  {"pitfall":<24}  {"damage":<6}  {"fix matches":<11}  symptom measured (wrong version)',
    ]
    for r in rows:
        fix = 'yes' if r['fix_matches'] else 'NO'
        lines.append(f'{r["number"]:>2}  {r["name"]:<24}  {damage_cell(r):<6}  {fix:<11}  {r["symptom"]}')
    lines += ['', 'fixed versions:']
    lines += [f'{r["number"]:>2}  {r["name"]:<24}  {r["fix"]}' for r in rows]
    notes = []
    if any(not r['damage_shown'] and r.get('changes_nothing') for r in rows):
        notes.append(
            f'{NO_DAMAGE_OF_ITS_OWN} no damage of its own: the wrong version changes nothing, measured (the same '
            'program, bitwise the same results); the trap is what it fails to do, in the symptom'
        )
    if any(not r['damage_shown'] and not r.get('damage_required', True) for r in rows):
        notes.append('* a hazard that cannot be forced on every machine; see the case module docstring')
    lines += ['', *notes] if notes else []
    bad = [r['name'] for r in rows if not r['documented']]
    verdict = f'{len(rows) - len(bad)} of {len(rows)} cases behave as documented'
    return '\n'.join([*lines, '', verdict + (f'; not: {", ".join(bad)}' if bad else '')])


def work(validated) -> int:
    import jax

    from equivalence import pitfalls
    from equivalence.core.report import output

    args, n_devices = validated
    names = pitfalls.names()
    if args.list:
        for name in names:
            module = pitfalls.load(name)
            print(f'{module.NUMBER:>2}  {name:<24}  {module.TITLE}')
        return cli.EXIT_MATCH
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')  # the batch, as score_sde
    rows = run_cases([args.only] if args.only else names, n_devices)
    print(table(rows, n_devices, jax.default_backend()))
    if args.json is not None:
        output.write_json(args.json, json_report(rows, n_devices), overwrite=args.overwrite)
    return cli.EXIT_MATCH if all(r['documented'] for r in rows) else cli.EXIT_MISMATCH


def json_report(rows: list[dict], n_devices: int) -> dict:
    from equivalence.core.report.render import versions

    return {
        'all_documented': all(r['documented'] for r in rows),
        'devices': n_devices,
        'cases': rows,
        'versions': versions(),
    }


def main(argv: list[str] | None = None) -> int:
    return cli.main(inputs, work, argv)


if __name__ == '__main__':
    sys.exit(main())
