"""Several processes: the same equivalence when the devices belong to several processes.

The engine is JAX's multi-controller runtime (``jax.distributed``), nothing home-made:

- ``worker``: one process of a run, the mode a cluster runs (``--coordinator HOST:PORT
  --num-processes N --process-id I``, or ``--distributed`` and JAX's cluster detection).
- ``launch``: ``--processes N`` starts N such workers on this machine, and ends them all,
  with one line, when one dies.
- ``rows``: which rows of the global batch, and which per-device keys, this process feeds.
- ``gather``: reading state back as host arrays when no process may hold all of it (a
  conversion step before ``core/convert``, so that the comparison never sees processes).

Importing this package imports no JAX: a worker must join the runtime before JAX starts. It is a
runtime the command layer calls (``equivalence.cli.dispatch`` picks one process, a worker or the
launcher); nothing here imports the command layer.
"""

from equivalence.distributed.worker import add_flags, progress_log, reports, several

__all__ = ['add_flags', 'progress_log', 'reports', 'several']
