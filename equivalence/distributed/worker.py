"""One process of a multi-process run: the mode a cluster runs, and the mode ``--processes`` starts.

A worker joins JAX's multi-controller runtime (``jax.distributed.initialize``) before any
JAX computation, then runs the command like a single process would: every process runs
the same program on its own devices, the collectives cross process boundaries, and
process 0 prints the report. The coordinator address, process count and process id come
from ``--coordinator`` / ``--num-processes`` / ``--process-id``; those left out are
detected by JAX from the cluster's environment (SLURM, Open MPI; ``JAX_COORDINATOR_ADDRESS``).

Ending: a worker whose command fails leaves at once with ``os._exit``. A normal exit
would wait in the runtime's shutdown barrier for processes that are themselves blocked
in a collective waiting for it; leaving lets the others' heartbeat see it gone.
"""

import argparse
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable

from equivalence.distributed import records

INIT_TIMEOUT_S = 60  # every process must have joined by then: a cluster starts its tasks within seconds
HEARTBEAT_TIMEOUT_S = 10  # a dead peer is noticed after this (measured: survivors abort ~8 s after a SIGKILL)
JAX_INIT_GRACE_S = 10  # JAX's own connect deadline comes this much later, so that ours speaks first
NO_CLUSTER = (
    'no cluster environment detected: JAX reads SLURM, Open MPI, Kubernetes or Cloud TPU variables, '
    'or JAX_COORDINATOR_ADDRESS; give --coordinator, --num-processes and --process-id'
)
EXIT_INTERNAL = 3  # an exception in this process (the suite's exit code for internal errors)
EXIT_WORKER = 4  # this process could not join the run, or a worker died (cli.EXIT_WORKER_DIED)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of several processes, shared by run, explain and bench."""
    group = parser.add_argument_group('several processes (docs/cluster.md)')
    add = group.add_argument
    add('--processes', type=int, default=1, metavar='N', help='start N local worker processes (D/N devices each)')
    add('--distributed', action='store_true', help='be one worker of a multi-process run (jax.distributed)')
    add('--coordinator', default=None, metavar='HOST:PORT', help="process 0's address (implies --distributed)")
    add('--num-processes', type=int, default=None, metavar='N', help='processes in the run (implies --distributed)')
    add('--process-id', type=int, default=None, metavar='I', help="this worker's id, 0..N-1 (implies --distributed)")
    add('--init-timeout', type=int, default=INIT_TIMEOUT_S, metavar='S', help=f'seconds to join ({INIT_TIMEOUT_S})')
    add('--heartbeat-timeout', type=int, default=HEARTBEAT_TIMEOUT_S, metavar='S', help='a silent peer is dead after S')
    add('--worker-logs', default=None, metavar='DIR', help="with --processes: write the workers' logs into DIR")


def is_worker(args: argparse.Namespace) -> bool:
    return bool(args.distributed or args.coordinator or args.num_processes is not None or args.process_id is not None)


JOINED = []  # [True] once this process has joined a run (a launcher never joins, nor starts JAX's backend)


def join(args: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` with deliberate timeouts; a run that does not form within
    ``--init-timeout`` ends this process with one line saying why (JAX's own failure is an abort)."""
    import jax

    if args.process_id is not None and args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        _leave(records.error(f'--process-id must be in 0..{args.num_processes - 1}, got {args.process_id}'), 2)
    timer = threading.Timer(args.init_timeout, _gave_up, (args, time.monotonic()))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            args.coordinator,
            args.num_processes,
            args.process_id,
            initialization_timeout=args.init_timeout + JAX_INIT_GRACE_S,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        )
    except ValueError as e:  # JAX found no cluster environment to fill in what the flags left out
        _leave(records.error(f'--distributed: {NO_CLUSTER} (JAX: {str(e).strip()})'), 2)
    finally:
        timer.cancel()
    JOINED.append(True)
    keep_stdout_for_the_report(jax.process_index())


def _gave_up(args: argparse.Namespace, started: float) -> None:
    where = args.coordinator or os.environ.get('JAX_COORDINATOR_ADDRESS') or 'the detected coordinator'
    waited = time.monotonic() - started
    said = (f'no run formed through {where} within {waited:.0f} s (--init-timeout {args.init_timeout}): '
            f'{_probe(args.coordinator)}')  # fmt: skip
    _leave(records.error(said, where=f'process {_id(args)} of {_count(args)}'), EXIT_WORKER)


def _probe(address: str | None) -> str:
    """What a plain TCP connect to the coordinator says: the likeliest reason a run did not form."""
    if not address or ':' not in address:
        return 'not every process joined'
    host, port = address.rsplit(':', 1)
    try:
        socket.create_connection((host.strip('[]'), int(port)), timeout=2).close()
    except (OSError, ValueError) as e:
        return f'the coordinator cannot be reached ({getattr(e, "strerror", None) or e})'
    return 'the coordinator is up, but not every process joined'


def _id(args: argparse.Namespace) -> str:
    return '?' if args.process_id is None else str(args.process_id)


def _count(args: argparse.Namespace) -> str:
    return '?' if args.num_processes is None else str(args.num_processes)


def keep_stdout_for_the_report(process_index: int) -> None:
    """Native libraries print to file descriptor 1 (gloo announces every connection there):
    send that to stderr, and keep the real stdout for process 0's report. The other processes
    print no report: their Python stdout is discarded."""
    sys.stdout.flush()
    report_fd = os.dup(1)
    os.dup2(2, 1)
    if process_index == 0:
        sys.stdout = open(report_fd, 'w', buffering=1, closefd=True)  # noqa: SIM115 -- lives as long as the process
    else:
        os.close(report_fd)
        sys.stdout = open(os.devnull, 'w')  # noqa: SIM115


def reports() -> bool:
    """Whether this process writes the report and files: the only process, or process 0 of several."""
    if 'jax' not in sys.modules:
        return True
    import jax

    return jax.process_index() == 0


def several() -> bool:
    """Whether this process is one of several in a ``jax.distributed`` run."""
    if 'jax' not in sys.modules:
        return False
    import jax

    return jax.process_count() > 1


def progress_log(total: int) -> Callable[[str], None]:
    """One stderr line per compiled call, for a worker's log (its stderr is no terminal)."""
    done = [0]

    def tick(path: str) -> None:
        import jax

        done[0] += 1
        print(f'process {jax.process_index()}: compiled call {done[0]}/{total} ({path})', file=sys.stderr, flush=True)

    return tick


def run(args: argparse.Namespace, body: Callable[[], int]) -> int:
    """The command's body as one worker: join, run, and end together (or leave at once on failure)."""
    join(args)
    try:
        code = body()
    except SystemExit as e:  # cli.fail: the one line is already on stderr
        code = e.code if isinstance(e.code, int) else EXIT_INTERNAL
    except BaseException as e:  # noqa: BLE001 -- any exception ends this worker with one line
        traceback.print_exc()
        code = _internal(e)
    if code not in (0, 1):
        _leave(None, code)
    import jax

    jax.distributed.shutdown()  # every process reached the end: the barrier is short
    return code


# What a collective of this process says when a peer's connection is gone (gloo on CPU, NCCL's
# remote error on GPU): read by ``cli.main`` (which every worker's command runs in) as "a worker
# died", exit 4, not as an internal error. Which notices a SIGKILLed peer first, this or JAX's
# heartbeat, depends on where the survivor was.
PEER_LOST = re.compile(r'Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|'
                       r'NCCL_ERROR_REMOTE_ERROR', re.IGNORECASE)  # fmt: skip


def peer_lost(e: BaseException) -> str | None:
    """One line (recorded for the launcher), when ``e`` is a collective failing because a peer process
    left the run; else None."""
    if 'jax' not in sys.modules or not several():
        return None
    if type(e).__name__ != 'JaxRuntimeError' or not PEER_LOST.search(str(e)):
        return None
    import jax

    said = f'a peer process left the run during a collective ({_first_line(e)})'
    return records.error(said, where=f'process {jax.process_index()} of {jax.process_count()}')


def _internal(e: BaseException) -> int:
    import jax

    line = records.error(_first_line(e), where=f'process {jax.process_index()}', internal=True)
    print(line, file=sys.stderr, flush=True)
    return EXIT_INTERNAL


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f'{type(e).__name__}: {text[0]}' if text else type(e).__name__


def _leave(line: str | None, code: int) -> None:
    """Print ``line`` and end this process now: no atexit handlers, no shutdown barrier."""
    if line:
        print(line, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
