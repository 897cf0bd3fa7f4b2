"""``python -m equivalence``: the commands, one line each, and where the guides are.

Imports no JAX and runs nothing: it is the front door for someone who typed the package name.
"""

import sys

COMMANDS = (
    ('equivalence.run', 'train both paths from one seed, compare every leaf: MATCH, MISMATCH or NOT VERIFIED'),
    ('equivalence.record --out FILE', 'the pmap side recorded once; run --reference FILE checks the port against it'),
    ('equivalence.explain', 'what XLA compiled for each path: collectives, placements, memory, three answers'),
    ('equivalence.bench', 'steps/s, dispatch and compile time of both paths and NNX variants, side by side'),
    ('equivalence.pitfalls', 'eleven porting traps, each run wrong (damage measured) and fixed (matches)'),
    ('equivalence.checkpoint migrate LEGACY_DIR NNX_DIR', 'a legacy (linen, pmap) checkpoint -> an NNX one'),
    ('equivalence.checkpoint verify NNX_DIR', 'every file and leaf of a migrated checkpoint against its sha256'),
    ('equivalence.corpus', "the verdict's own test: correct ill-conditioned ports and slips, a confusion matrix"),
)
GUIDES = (
    ('docs/port.md', 'check your own port: ModelPort, LoopPort, names, randomness, the pytest plugin'),
    ('docs/ladder.md', 'the migration as rungs: pmap linen -> jit linen -> NNX, each checked the same way'),
    ('docs/verdict.md', 'what MATCH proves, the tolerance and why, run flags, the JSON report'),
    ('docs/commands.md', 'what every command shares: validation, exit codes 0 to 5 and 130, reports'),
    ('docs/reference.md', 'record once, check forever: the pmap side recorded, checked after its code is gone'),
    ('docs/accelerators.md', 'on one TPU chip or GPU: the floor, the precision, every command, measured'),
    ('docs/strategies.md', 'FSDP, TP, 2-D meshes and shard_map, each checked against pmap'),
    ('docs/cluster.md', 'several processes and clusters: --processes, SLURM, timeouts'),
    ('docs/checkpoints.md', 'legacy saves, migrate, restoring onto a mesh, run --resume-at'),
    ('docs/explain.md', 'what each path compiles to, the plots, the two steps side by side'),
    ('docs/performance.md', 'bench, with the benchmark tables, their date and machine'),
    ('docs/pitfalls.md', 'eleven porting traps, measured'),
    ('docs/workloads.md', 'the built-in workloads'),
    ('docs/randomness.md', 'the two --rng modes'),
    ('docs/layout.md', 'how the repository is laid out'),
    ('docs/versions.md', 'versions, and why pmap is the legacy path'),
)
EXIT_CODES = (  # every command's --help lists the ones it can give
    ('0', 'MATCH (run); done (the other commands)'),
    ('1', 'MISMATCH (run; pitfalls: a case not as documented; corpus: a wrong verdict)'),
    ('2', 'bad input: one "error: ..." line naming the flag, or the port field and your file:line'),
    ('3', 'internal error: a bug in this suite, not a verdict; the traceback in a temporary file'),
    ('4', 'several processes (run, explain, bench): a worker died or could not join'),
    ('5', 'NOT VERIFIED (run): no verdict either way; where a slip would hide, noise dominates'),
    ('130', 'interrupted (Ctrl-C)'),
)
USAGE = '--workload takes a built-in (mlp, wide, score, cnn) or your port as module:NAME; every command has --help.'


def text() -> str:
    width = max(len(name) for name, _ in COMMANDS) + len('python -m ')
    lines = ['pmap -> NNX on a mesh: does the port train the same model?', '', 'commands:']
    lines += [f'  {"python -m " + name:<{width}}  {what}' for name, what in COMMANDS]
    lines += ['', USAGE, '', 'exit codes:']
    lines += [f'  {code}  {what}' for code, what in EXIT_CODES]
    lines += ['', 'guides (in the repository; README.md first):']
    lines += [f'  {path:<20}  {what}' for path, what in GUIDES]
    return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] not in ('-h', '--help'):
        commands = ', '.join('python -m ' + name.split()[0] for name, _ in COMMANDS)
        print(
            f'error: python -m equivalence takes no arguments, got {argv[0]!r}; commands: {commands}', file=sys.stderr
        )
        return 2
    print(text())
    return 0


if __name__ == '__main__':
    sys.exit(main())
