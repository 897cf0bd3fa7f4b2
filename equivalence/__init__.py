"""Proof that a linen ``jax.pmap(lax.scan(step))`` loop and its Flax NNX port on a mesh train the same model.

The parts, each a folder or module (importing this package imports no JAX: the commands
request simulated devices first):

- ``core/``: the typed config, the built-in workloads, the conversion of both frameworks'
  state to one neutral form, the leaf-by-leaf comparison, the harness that runs both paths,
  and the report of a run.
- ``run``: ``python -m equivalence.run``; ``explain/``, ``bench/``, ``pitfalls/``: the other
  commands, each a package whose ``__main__`` only parses flags, calls the library and prints.
- ``distributed/``: several processes through ``jax.distributed``: the worker mode a cluster
  runs, the local launcher of ``--processes N``, each process's rows, reading state back.
- ``cli``, ``devices``: what every command shares (flags, one-line errors, exit codes, devices).

The public API, for checking your own port (``docs/tutorial.md`` and ``docs/port.md``):
``ModelPort``, ``LoopPort``, ``check``, ``read_groups`` (``from equivalence import ModelPort``); and the
pytest plugin ``equivalence.testing``. They load on first use, so that importing this
package still imports no JAX.
"""

import sys as _sys

if _sys.argv[:1] == ['-m']:  # a command starting (``python -m equivalence...``; argv[0] is '-m' until it runs)
    from equivalence import stdlib_shadow as _stdlib_shadow

    _stdlib_shadow.guard()  # a user's random.py shadowing the standard library's: one line, exit 2

_PUBLIC = {
    'ModelPort': ('equivalence.core.port.ports', 'ModelPort'),
    'LoopPort': ('equivalence.core.port.ports', 'LoopPort'),
    'PortError': ('equivalence.core.port.naming', 'PortError'),
    'ConfigError': ('equivalence.core.port.config', 'ConfigError'),
    'check': ('equivalence.core.harness', 'check'),
    'RECORDED': ('equivalence.core.port.port_fields', 'RECORDED'),  # a pmap-side field read from a reference
    'read_groups': ('equivalence.core.state.new_side', 'read_groups'),  # new_groups='s default, to start from
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    import importlib

    module, attr = _PUBLIC[name]
    return getattr(importlib.import_module(module), attr)
