"""Several processes: the same equivalence when the devices belong to several processes.

The engine is JAX's multi-controller runtime (``jax.distributed``), nothing home-made:

- ``worker``: one process of a run, the mode a cluster runs (``--coordinator HOST:PORT
  --num-processes N --process-id I``, or ``--distributed`` and JAX's cluster detection).
- ``launch``: ``--processes N`` starts N such workers on this machine, and ends them all,
  with one line, when one dies.
- ``rows``: which rows of the global batch, and which per-device keys, this process feeds.
- ``gather``: reading state back as host arrays when no process may hold all of it (a
  conversion step before ``core/convert``, so that the comparison never sees processes).

Importing this package imports no JAX: a worker must join the runtime before JAX starts.
"""

import argparse
import sys
from collections.abc import Callable, Sequence

from equivalence.distributed.worker import add_flags, progress_log, reports, several

__all__ = ['add_flags', 'command', 'progress_log', 'reports', 'several']


def command(module: str, argv: Sequence[str] | None, args: argparse.Namespace, check: Callable, body: Callable) -> int:
    """Run a command in the mode its flags ask for: one process (the default), one worker of
    several, or the local launcher of ``--processes N`` workers. ``check`` (its output paths)
    runs where the report is written, before any work; ``body`` does the work, returns the exit code."""
    from equivalence.distributed import launch, worker

    several_processes = args.processes != 1 or worker.is_worker(args)
    if several_processes and (getattr(args, 'strategy', 'dp'), getattr(args, 'nnx_form', 'split')) != ('dp', 'split'):
        from equivalence import cli

        cli.fail('several processes run --strategy dp in split form, the pmap-equivalent one; other strategies '
                 'and --nnx-form graph are checked in one process')  # fmt: skip
    if args.processes != 1:
        from equivalence import devices

        check()
        total = args.devices or devices.default_count()
        return launch.run(module, sys.argv[1:] if argv is None else argv, args, total)
    if worker.is_worker(args):
        return worker.run(args, lambda: _checked(check, body))
    return _checked(check, body)


def _checked(check: Callable, body: Callable) -> int:
    if reports():  # only the process that writes the report checks where it goes
        check()
    return body()
