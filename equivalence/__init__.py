"""Proof that a linen ``jax.pmap(lax.scan(step))`` loop and its Flax NNX port on a mesh train the same model.

The parts, each a folder or module (importing this package imports no JAX: the commands
request simulated devices first):

- ``core/``: the typed config, the built-in workloads, the conversion of both frameworks'
  state to one neutral form, the leaf-by-leaf comparison, the harness that runs both paths,
  and the report of a run.
- ``run``: ``python -m equivalence.run``; ``explain/``, ``bench/``, ``pitfalls/``: the other
  commands, each a package whose ``__main__`` only parses flags, calls the library and prints.
- ``cli``, ``devices``: what every command shares (flags, one-line errors, exit codes, devices).
"""
