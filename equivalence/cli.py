"""What every ``python -m equivalence.<cmd>`` shares: flags, validation, one-line errors, exit codes.

A command is two functions: ``inputs(argv)`` parses and validates every flag and runs
nothing (bad input: one ``error: ...`` line, exit 2), and ``work(inputs)`` does the job and
returns 0 or 1. ``main`` runs them in that order and turns any other exception into exit 3.
Nothing here imports JAX: the device count must be requested before JAX starts.
"""

import argparse
import os
import re
import shlex
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import NoReturn, TypeVar

from equivalence import compat, compilation_cache, devices
from equivalence.core.compare.outcome import Outcome
from equivalence.core.port import blame
from equivalence.core.port.config import ConfigError
from equivalence.distributed import records, worker

EXIT_MATCH, EXIT_MISMATCH = Outcome.MATCH.exit_code, Outcome.MISMATCH.exit_code  # a check's outcome (run)
EXIT_NOT_VERIFIED = Outcome.NOT_VERIFIED.exit_code  # run: every leaf compares, but where a slip would hide is noise
EXIT_BAD_INPUT, EXIT_INTERNAL = 2, 3
EXIT_WORKER_DIED = 4  # several processes: a worker died or could not join (equivalence.distributed)
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it
INJECT_INTERNAL_ERROR = 'EQUIVALENCE_INJECT_INTERNAL_ERROR'  # tests only: '1' raises once the flags are valid
INTERNAL = 'internal error: a bug in this suite, not a verdict on the port'

Inputs = TypeVar('Inputs')


def exit_codes(ok: str, mismatch: str | None = None, workers: bool = True, unverified: str | None = None) -> str:
    """The exit-code paragraph of a command's ``--help``: only the codes the command can give
    (``workers``: it can run as several processes, so a worker can die)."""
    lines = ['exit codes:', f'  0  {ok}']
    lines += [f'  1  {mismatch}'] if mismatch else []
    lines += [
        '  2  bad input or a mistake in the port: one "error: ..." line on stderr naming the flag, or',
        '     the port field and the file:line in your code (checked before anything trains)',
        '  3  internal error: a bug in this suite, not a verdict on the port; stderr names the',
        '     file holding the traceback',
    ]
    lines += ['  4  several processes: a worker died or could not join (one line naming it)'] if workers else []
    lines += [f'  5  {unverified}'] if unverified else []
    lines += [f'  {EXIT_INTERRUPTED}  interrupted (Ctrl-C): "interrupted" on stderr; no report is left half written']
    return '\n'.join(lines)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit 2, no usage dump."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self.add_argument(
            compilation_cache.FLAG,
            action='store_true',
            help="compile every program afresh: do not read or write JAX's persistent compilation cache "
            '(on by default, in ~/.cache/equivalence/jax or $JAX_COMPILATION_CACHE_DIR)',
        )
        # Python 3.13's rule: '-1e-3' and '-.5' are values, not flags (3.11 knows only '-1' and '-0.5').
        self._negative_number_matcher = re.compile(r'^-\.?\d')

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        for action in self._actions:  # Python 3.11 reads '--devices=--' as an empty list, not an error
            if action.nargs is None and isinstance(getattr(parsed, action.dest, None), list):
                self.error(f'argument {"/".join(action.option_strings)}: expected one argument')
        return parsed

    def error(self, message: str) -> NoReturn:
        fail(f'{message} (see --help)')


def fail(message: str, whole: str = '') -> NoReturn:
    """One ``error:`` line and exit 2; ``whole``, the text the line shortened, goes to a file it names."""
    line = ' '.join(str(message).splitlines())
    print(records.error(line + (f'; {_whole_text_file(whole)}' if whole else '')), file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def _whole_text_file(whole: str) -> str:
    try:
        with tempfile.NamedTemporaryFile('w', prefix='equivalence-', suffix='.error.txt', delete=False) as f:
            f.write(whole)
    except OSError as e:
        return f'the whole text could not be written to a file ({e.strerror})'
    return f'whole text in {f.name}'


def add_run_flags(
    parser: argparse.ArgumentParser,
    workloads: list[str],
    calls_help: str | None = None,
    calls_default: int = 4,
    strategy_help: str = 'NNX placement: dp, fsdp, tp, fsdp-tp, shard_map (default dp)',
    placement: bool = True,
) -> None:
    """The flags that make a ``RunConfig``; ``None`` means "not given", never a value to replace. ``placement``:
    ``--strategy`` and ``--mesh``, which place the new side (``record``, which never runs it, has neither)."""
    parser.add_argument(
        '--workload',
        default='mlp',
        metavar='NAME',
        help=f'a built-in ({", ".join(workloads)}; default mlp) or your own port as package.module:NAME '
        '(a ModelPort or LoopPort, or a function returning one; its folder on PYTHONPATH or the current directory)',
    )
    parser.add_argument('--devices', type=int, default=None, help='D devices (default: all; 8 simulated on CPU)')
    parser.add_argument('--steps-per-call', type=int, default=None, help='K steps fused per call (default 5)')
    parser.add_argument('--calls', type=int, default=None, help=calls_help or 'C compiled calls (default 4)')
    parser.add_argument('--batch-size', type=int, default=None, help="global batch (default: the workload's)")
    parser.add_argument('--seed', type=int, default=None, help='seed of data, parameters and keys, 0 <= S < 2**32')
    parser.set_defaults(unset={'steps_per_call': 5, 'calls': calls_default, 'seed': 0})  # the values of flags not
    # given, where no reference gives them (run --reference: its own, ``run_config``)
    parser.add_argument('--rng', default=None, help="per-device (score_sde) or global (default: the port's first)")
    if placement:
        parser.add_argument('--strategy', default='dp', help=strategy_help)
        mesh_help = "fsdp-tp's 2-D mesh, data=A,model=B (default data=D/2,model=2)"
        parser.add_argument('--mesh', default=None, help=mesh_help)


def add_output_flags(parser: argparse.ArgumentParser, json_help: str, plot: bool = False) -> None:
    """``--json`` (and ``--plot``): checked by ``parse`` before anything runs, written atomically."""
    parser.add_argument('--json', default=None, metavar='PATH', help=json_help)
    if plot:
        parser.add_argument(
            '--plot',
            default=None,
            metavar='DIR',
            help='write losses.png and divergence.png (and location.png when located) into DIR',
        )
    parser.add_argument('--overwrite', action='store_true', help='replace an existing report')


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Flags -> namespace, with the output targets checked; raises ``ConfigError`` on a bad target."""
    from equivalence.core.report import output

    args = parser.parse_args(argv)
    if getattr(args, 'json', None) is not None:
        output.check_file(args.json, args.overwrite)
    if getattr(args, 'plot', None) is not None:
        from equivalence.core.report import plots

        output.check_dir(args.plot, plots.FILES, args.overwrite)
    return args


def available_devices(n_available: int | None = None) -> int:
    """The devices JAX sees (starts JAX's backend), unless the caller already knows."""
    if n_available is not None:
        return n_available
    import jax

    return len(jax.devices())


def run_config(args: argparse.Namespace, n_available: int | None = None, recording: bool = False, **extra):
    """The flags of ``add_run_flags`` -> ``(workload, RunConfig)``, the port's own limits checked
    too (``harness.validate``; ``recording``: for ``record``); raises ``ConfigError`` on bad input."""
    from equivalence.core import harness
    from equivalence.core.port import workloads
    from equivalence.core.port.config import RunConfig, parse_mesh

    wl = workloads.get(args.workload)
    available = available_devices(n_available)
    given = _given(args, {'devices': available, 'batch_size': wl.default_batch, 'rng': wl.rng_modes[0]})
    config = RunConfig(
        workload=wl.name,
        devices=given('devices'),
        steps_per_call=given('steps_per_call'),
        calls=given('calls'),
        batch_size=given('batch_size'),
        seed=given('seed'),
        rng_mode=given('rng'),
        strategy=getattr(args, 'strategy', 'dp'),
        mesh=parse_mesh(args.mesh) if getattr(args, 'mesh', None) is not None else None,
        available=available,
        **extra,
    )
    check_processes(config, available)
    harness.validate(wl, config, recording)
    return wl, config


def _given(args: argparse.Namespace, defaults: dict) -> Callable[[str], object]:
    """``flag name -> its value``: as given; else, with ``--reference``, what the reference was recorded with (so
    that ``run --reference FILE`` checks the run it holds); else its default (``defaults``, ``args.unset``)."""
    recorded = {}
    if getattr(args, 'reference', None) is not None:
        from equivalence.core.reference import reference

        recorded = reference.recorded_config(args.reference)  # a file that is no reference: its one line, exit 2
        recorded['rng'] = recorded.get('rng_mode')
    defaults = {**getattr(args, 'unset', {}), **defaults}
    return lambda name: next((v for v in (getattr(args, name), recorded.get(name)) if v is not None), defaults[name])


def check_processes(config, n_available: int) -> None:
    """With several processes, pmap and the mesh span every device of every process. Asked only
    of a process that joined a run: the launcher must not start JAX's backend before it forks."""
    from equivalence.distributed import worker

    if not worker.JOINED:
        return
    import jax

    if jax.process_count() > 1 and config.devices != n_available:
        raise ConfigError(
            f'--devices {config.devices}: a run of {jax.process_count()} processes uses all their {n_available} devices'
        )


def validate(inputs: Callable[[list[str] | None], Inputs], argv: list[str] | None) -> Inputs:
    """``inputs(argv)``, with bad input turned into one ``error:`` line and exit 2. Runs nothing."""
    try:
        return inputs(argv)
    except ConfigError as e:
        fail(str(e), getattr(e, 'whole', ''))


def main(
    inputs: Callable[[list[str] | None], Inputs], work: Callable[[Inputs], int], argv: list[str] | None = None
) -> int:
    """One command: devices requested, every flag validated, then the work. Exit 0/1 from ``work``,
    2 on bad input, 3 on anything unexpected (a bug here, which must not read as a mismatch)."""
    try:
        too_old(command_name(inputs))
        devices.simulate_cpu_devices()  # before anything imports jax
        devices.quiet_xla_warnings()
        compilation_cache.use(argv)  # before the port is imported
        validated = validate(inputs, argv)
        if os.environ.get(INJECT_INTERNAL_ERROR) == '1':
            raise RuntimeError(f'injected by {INJECT_INTERNAL_ERROR}=1')
        compilation_cache.keep_programs_with_callbacks()  # JAX may be imported only now; devices chosen
        return work(validated)
    except ConfigError as e:  # found only while working, e.g. an optional dependency missing
        fail(str(e), getattr(e, 'whole', ''))
    except KeyboardInterrupt:
        print('interrupted', file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 -- every unexpected failure becomes exit 3, with its traceback kept
        lost = worker.peer_lost(e)  # several processes: a peer died under a collective, not our bug
        if lost is not None:
            print(lost, file=sys.stderr)
            return EXIT_WORKER_DIED
        memory = out_of_memory(e)  # the device's memory, not a bug: one line, exit 2
        if memory is not None:
            fail(memory)
        line = blame.runtime_line(e)  # raised in the port's own code: the port's mistake, exit 2
        if line is not None:
            fail(line, blame.whole_text(e) if blame.elided(e) else '')
        return internal_error(e, command_name(inputs), sys.argv[1:] if argv is None else argv)


def out_of_memory(error: Exception) -> str | None:
    """The line for a device that ran out of memory while a command ran (XLA's ``RESOURCE_EXHAUSTED``), with
    XLA's own figures; None for any other error. The check holds more than a team's own training (``fits``)."""
    text = ' '.join(str(error).split())
    if not (isinstance(error, RuntimeError) and text.startswith('RESOURCE_EXHAUSTED')):
        return None
    said = re.search(r'(Attempting to allocate [^;]*?free\.|Ran out of memory[^;.]*|Out of memory[^;.]*)', text)
    return (
        f'the device ran out of memory ({said.group(1) if said else text[:160]}): the programs the suite builds '
        'donate no train state, so their steps hold two (docs/record.md); check a smaller size of the model or a '
        'smaller batch, or on a device that holds more'
    )


def too_old(command: str) -> None:
    """Every command but ``record`` needs the JAX the suite was tried on (``pyproject.toml``'s ``check``); an
    older one (a team's jax 0.4 environment, where the pmap code runs) is one line naming what it can do."""
    found = compat.version()
    if command != 'equivalence.record' and found and found < (0, 10):
        jax_version = '.'.join(map(str, found))
        install = f"pip install -e '{suite_root()}[check]'"  # this suite, from its checkout: on no registry
        fail(f'{command} needs jax 0.10 (this environment has jax {jax_version}): record the pmap side here with '
             f'python -m equivalence.record, and check it in an environment where {install} (this suite, from its '
             'checkout) has put the versions it was tried on (docs/record.md)')  # fmt: skip


def suite_root() -> str:
    """The folder this suite is installed from (its checkout, holding pyproject.toml); else a placeholder."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root if os.path.isfile(os.path.join(root, 'pyproject.toml')) else 'path/to/this/suite'


def command_name(fn: Callable) -> str:
    """'equivalence.run' for a function of that command, also when it runs as ``__main__``."""
    spec = getattr(sys.modules.get(fn.__module__), '__spec__', None)
    return (spec.name if spec else fn.__module__).removesuffix('.__main__')


def internal_error(error: Exception, command: str, argv: list[str]) -> int:
    """One line on stderr; the traceback, with the command line, in a file that outlives the run."""
    text = f'command: python -m {command} {shlex.join(map(str, argv))}\n\n{traceback.format_exc()}'
    try:
        with tempfile.NamedTemporaryFile('w', prefix=f'{command}-', suffix='.traceback.txt', delete=False) as f:
            f.write(text)
        where = f'full traceback in {f.name}'
    except OSError as e:
        where = f'the traceback could not be written to a file ({e.strerror})'
    print(f'{INTERNAL} ({blame.first_line(error)}); {where}', file=sys.stderr)
    return EXIT_INTERNAL


def dispatch(module: str, inputs: Callable, work: Callable, argv: list[str] | None = None) -> int:
    """A command in the mode its flags ask for: one process (the default), one worker of several
    (join the runtime first, then the command as usual), or the local launcher of
    ``--processes N`` workers, which checks every flag against the whole run before starting them.
    ``inputs(argv, n_available)`` and ``work(validated)`` are the command's (``main``); the
    runtime is ``equivalence.distributed``."""
    from equivalence.distributed import launch

    args = _process_flags(argv)
    if args.processes != 1:
        total = args.devices or devices.default_count()
        argv_list = list(sys.argv[1:] if argv is None else argv)
        return main(lambda a: inputs(a, total), lambda v: launch.run(module, argv_list, v[0], total), argv)
    if worker.is_worker(args):
        return worker.run(args, lambda: main(inputs, work, argv))
    return main(inputs, work, argv)


class _Quiet(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def _process_flags(argv: list[str] | None) -> argparse.Namespace:
    """The process flags alone (the command's own parser checks everything, in ``inputs``)."""
    parser = _Quiet(add_help=False)
    worker.add_flags(parser)
    parser.add_argument('--devices', type=int, default=None)
    try:
        args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    except ValueError:  # a malformed value: the command's parser will say which, in one line
        args = parser.parse_args([])
    return args
