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

__all__ = ['add_flags', 'main', 'progress_log', 'reports', 'several']


def main(module: str, inputs: Callable, work: Callable, argv: Sequence[str] | None = None) -> int:
    """A command in the mode its flags ask for: one process (the default), one worker of several
    (join the runtime first, then the command as usual), or the local launcher of
    ``--processes N`` workers, which checks every flag against the whole run before starting them.
    ``inputs(argv, n_available)`` and ``work(validated)`` are the command's (``cli.main``)."""
    from equivalence import cli
    from equivalence.distributed import launch, worker

    args = _flags(argv)
    if args.processes != 1 or worker.is_worker(args):
        strategy, form = getattr(args, 'strategy', 'dp'), getattr(args, 'nnx_form', 'split')
        if (strategy, form) != ('dp', 'split'):
            cli.fail('several processes run --strategy dp in split form, the pmap-equivalent one; other '
                     'strategies and --nnx-form graph are checked in one process')  # fmt: skip
    if args.processes != 1:
        from equivalence import devices

        total = args.devices or devices.default_count()
        argv_list = list(sys.argv[1:] if argv is None else argv)
        return cli.main(lambda a: inputs(a, total), lambda v: launch.run(module, argv_list, v[0], total), argv)
    if worker.is_worker(args):
        return worker.run(args, lambda: cli.main(inputs, work, argv))
    return cli.main(inputs, work, argv)


class _Quiet(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def _flags(argv: Sequence[str] | None) -> argparse.Namespace:
    """The process flags alone (the command's own parser checks everything, in ``inputs``)."""
    parser = _Quiet(add_help=False)
    add_flags(parser)
    for flag in ('--devices',):
        parser.add_argument(flag, type=int, default=None)
    parser.add_argument('--strategy', default='dp')
    parser.add_argument('--nnx-form', default='split')
    try:
        args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    except ValueError:  # a malformed value: the command's parser will say which, in one line
        args = parser.parse_args([])
    return args
