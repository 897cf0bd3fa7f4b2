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
GUIDES = (  # README.md first; then the docs by kind: tutorial, how-to, reference, explanation, contributors
    ('docs/tutorial.md', 'tutorial: port a first model, from a pmap loop to a MATCH and a planted MISMATCH'),
    ('docs/ci.md', 'how-to: check the port from your tests and CI (the pytest plugin)'),
    ('docs/record.md', 'how-to: record the pmap side once, check the port against it after its code is gone'),
    ('docs/checkpoints.md', 'how-to: legacy saves, migrate, restoring onto a mesh, run --resume-at'),
    ('docs/cluster.md', 'how-to: several processes and clusters: --processes, SLURM, timeouts'),
    ('docs/accelerators.md', 'how-to: check on one TPU chip or GPU: the floor, the precision, every command'),
    ('docs/strategies.md', 'how-to: FSDP, TP, 2-D meshes and shard_map, each checked against pmap'),
    ('docs/ladder.md', 'how-to: migrate in rungs, pmap linen -> jit linen -> NNX, each checked the same way'),
    ('docs/fast.md', "how-to: make the NNX port as fast as its pmap loop (bench's advice)"),
    ('docs/explain.md', 'how-to: see what XLA compiled for each side, the plots, the two steps side by side'),
    ('docs/commands.md', 'reference: the commands and their flags, exit codes, reports, the compilation cache'),
    ('docs/json.md', "reference: the JSON report's keys"),
    ('docs/port.md', "reference: the port's fields, step forms, train states, names, the pre-flight"),
    ('docs/randomness.md', 'reference: the two --rng modes and the Dropout bridge'),
    ('docs/workloads.md', 'reference: the built-in workloads'),
    ('docs/examples.md', 'reference: the example ports, and three at the sizes teams train'),
    ('docs/pitfalls.md', 'reference: eleven porting traps, measured'),
    ('docs/versions.md', 'reference: versions, and why pmap is the legacy path'),
    ('docs/verdict.md', 'explanation: what MATCH proves, the measured floor, NOT VERIFIED'),
    ('docs/where.md', 'explanation: where: the sides part, and its limits'),
    ('docs/below-the-floor.md', "explanation: differences below one step's floor, and what a MATCH could miss"),
    ('docs/trials.md', 'explanation: the corpus and the real codebases the verdict was tried on'),
    ('docs/development.md', "contributors: the tests, their budget, the README's sample reports"),
    ('docs/layout.md', 'contributors: how the repository is laid out'),
    ('docs/performance.md', 'contributors: the measured figures, each with its command'),
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
    lines += [f'  {path:<24}  {what}' for path, what in GUIDES]
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
