"""``--processes N``: start N workers on this machine, in the very mode a cluster runs them.

Each worker is ``python -m <command> <the same flags> --coordinator 127.0.0.1:PORT
--num-processes N --process-id I`` with D/N simulated CPU devices, joined through a
coordinator on a free port of 127.0.0.1. Process 0's stdout is this command's stdout
(the report); every worker's stderr goes to a log file, and what it has to say to the launcher
(its one ``error:`` line) to a file of JSON records beside it (``records``).

The launcher never waits on a collective: it only watches its children. The first worker
that ends abnormally (a signal, an exception, a failed join) ends the run: the others are
killed with SIGKILL (SIGTERM is caught by JAX's preemption handler) and one line names the
worker and what happened. Exit codes: the workers' own when they agree (0 match, 1
mismatch), 2 bad input (the worker's one line), 4 a worker died or could not join.
"""

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from equivalence.core.port.config import ConfigError
from equivalence.distributed import records

POLL_S = 0.1  # how often the launcher looks at its workers
ENDING_TOGETHER_S = 20  # workers that finished normally leave within a shutdown barrier of each other
EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_WORKER_DIED, EXIT_NOT_VERIFIED = 2, 3, 4, 5  # as cli and worker
PROCESS_FLAGS = {'--processes': 1, '--worker-logs': 1}  # launcher-only flags -> values they take


def free_port() -> int:
    """A port nothing listens on now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def worker_argv(argv: Sequence[str], port: int, n: int, i: int) -> list[str]:
    """The command's own flags, less the launcher's, plus this worker's address flags."""
    out, skip = [], 0
    for arg in argv:
        name = arg.split('=', 1)[0]
        if skip:
            skip -= 1
        elif name in PROCESS_FLAGS:
            skip = PROCESS_FLAGS[name] if '=' not in arg else 0
        else:
            out.append(arg)
    return [*out, '--coordinator', f'127.0.0.1:{port}', '--num-processes', str(n), '--process-id', str(i)]


def worker_env(local_devices: int, port: int, said: str | None = None) -> dict[str, str]:
    """CPU only, D/N simulated devices, the coordinator bound to 127.0.0.1, unbuffered logs; ``said``:
    the file of the worker's records."""
    env = dict(os.environ)
    flags = [f for f in env.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
    env.update(
        JAX_PLATFORMS='cpu',
        JAX_NUM_CPU_DEVICES=str(local_devices),
        XLA_FLAGS=' '.join(flags),
        JAX_COORDINATOR_BIND_ADDRESS=f'127.0.0.1:{port}',  # read by jax.distributed.initialize
        PYTHONUNBUFFERED='1',
    )
    if said is not None:
        env[records.ENV] = said
    return env


def _die_with_parent() -> None:
    """Linux: a worker gets SIGKILL if the launcher itself dies, so no worker outlives it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start(module: str, argv: Sequence[str], n: int, local_devices: int, logs: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for i in range(n):
        command = [sys.executable, '-m', module, *worker_argv(argv, port, n, i)]
        log = open(os.path.join(logs, f'worker-{i}.log'), 'w')  # noqa: SIM115 -- the child holds it
        stdout = None if i == 0 else log
        env = worker_env(local_devices, port, records_path(logs, i))
        procs.append(subprocess.Popen(command, stdout=stdout, stderr=log, env=env, preexec_fn=_die_with_parent))
        log.close()
    with open(os.path.join(logs, 'workers.txt'), 'w') as f:
        f.writelines(f'{i} {p.pid} {" ".join(p.args)}\n' for i, p in enumerate(procs))
    return procs


def records_path(logs: str, i: int) -> str:
    """Where worker ``i`` writes its records (``records``): JSON, one line each."""
    return os.path.join(logs, f'worker-{i}.records.jsonl')


def supervise(procs: list[subprocess.Popen], logs: str) -> tuple[int, str | None]:
    """Wait until every worker ended well, or one did not: ``(exit code, one line or None)``."""
    t0, finished_at = time.monotonic(), None
    while True:
        codes = [p.poll() for p in procs]
        bad = [i for i, c in enumerate(codes) if c is not None and c not in (0, 1, EXIT_NOT_VERIFIED)]
        if bad:
            return failure(procs, codes, min(bad, key=lambda i: _rank(codes[i])), logs, time.monotonic() - t0)
        if None not in codes:
            if len(set(codes)) == 1:
                return codes[0], None
            return EXIT_WORKER_DIED, f'error: the workers disagree (exit codes {codes}); logs in {logs}'
        if finished_at is None and any(c is not None for c in codes):
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > ENDING_TOGETHER_S:
            i = codes.index(None)
            line = f'error: worker {i} of {len(procs)} (pid {procs[i].pid}) did not end within {ENDING_TOGETHER_S} s '
            return EXIT_WORKER_DIED, line + f'of the others; logs in {logs}'
        time.sleep(POLL_S)


def _rank(code: int) -> int:
    """Among workers found ended together, the cause before the consequences: a signal other than
    SIGABRT (JAX aborts the survivors of a dead peer), then an exit code, then an abort."""
    return 2 if code == -signal.SIGABRT else (0 if code < 0 else 1)


def failure(
    procs: list[subprocess.Popen], codes: list[int | None], i: int, logs: str, after_s: float
) -> tuple[int, str]:
    """The one line for worker ``i``'s end, and the launcher's exit code: the worker's own ``error:`` line
    (its last record) when it had one, else the most telling line of its log."""
    said = records.last_error(records_path(logs, i))
    code = codes[i]
    if code == EXIT_BAD_INPUT and said is not None:
        return EXIT_BAD_INPUT, said['line']
    reason = said['detail'] if said is not None else last_reason(os.path.join(logs, f'worker-{i}.log'))
    others = sum(1 for j, c in enumerate(codes) if j != i and c is None)
    stopped = f'; stopped the other {others} with SIGKILL' if others else ''
    who = f'worker {i} of {len(procs)} (pid {procs[i].pid})'
    return EXIT_WORKER_DIED, f'error: {who} {describe(code, reason)} after {after_s:.1f} s{stopped}; logs in {logs}'


def describe(code: int, reason: str) -> str:
    """What happened to a worker, from its exit status and what it said (its record's detail, or the
    telling line of its log)."""
    detail = f' ({reason})' if reason else ''
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f'signal {-code}'
        return f'was killed by {name}' + (detail if code == -signal.SIGABRT else '')
    if code == EXIT_INTERNAL:
        return 'failed with an internal error' + detail
    if code == EXIT_WORKER_DIED:
        return 'could not join the run' + detail
    return f'exited with code {code}' + detail


FATAL = re.compile(r'^[FE]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] (.*)')  # absl's fatal and error log lines
EXCEPTION = re.compile(r'^[\w.]+(Error|Exception|Interrupt)\b.*')


def last_reason(path: str, width: int = 240) -> str:
    """The most telling line of a worker's log that said nothing itself (no record): a fatal log line of
    the runtime (absl's), else the last Python exception, else the last line; ``width`` at most."""
    try:
        with open(path, errors='replace') as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ''
    for pick in (
        lambda s: m.group(1) if (m := FATAL.match(s)) else None,
        lambda s: s if EXCEPTION.match(s) else None,
    ):
        found = [p for p in map(pick, lines) if p]
        if found:
            return found[-1][:width]
    return lines[-1][:width] if lines else ''


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every worker still running, and reap them all."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def check(args: argparse.Namespace, devices: int) -> None:
    """Flags that make no sense together end here, before any worker starts (``ConfigError``: exit 2, one line)."""
    if args.processes < 1:
        raise ConfigError(f'--processes must be at least 1, got {args.processes}')
    if args.distributed or args.coordinator or args.num_processes is not None or args.process_id is not None:
        raise ConfigError('--processes starts its own workers: leave out --distributed and the address flags')
    if devices % args.processes:
        counts = [n for n in range(1, devices + 1) if devices % n == 0]
        raise ConfigError(
            f'--devices {devices} cannot be split over --processes {args.processes}: use --processes in {counts}'
        )


def run(module: str, argv: Sequence[str], args: argparse.Namespace, devices: int) -> int:
    """Start the workers, watch them, print at most one line; the run's exit code."""
    check(args, devices)
    logs = args.worker_logs or tempfile.mkdtemp(prefix='equivalence-workers-')
    os.makedirs(logs, exist_ok=True)
    procs = start(module, argv, args.processes, devices // args.processes, logs)
    try:
        code, line = supervise(procs, logs)
    except KeyboardInterrupt:
        code, line = 130, f'error: interrupted; stopped {len(procs)} workers; logs in {logs}'
    finally:
        stop(procs)
    if line:
        print(line, file=sys.stderr)
    elif args.worker_logs is None:
        shutil.rmtree(logs, ignore_errors=True)
    return code
