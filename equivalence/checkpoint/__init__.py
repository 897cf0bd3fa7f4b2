"""Checkpoints across the port: a pmap-era train state becomes an NNX train state on any mesh.

- ``options``: the checkpoint flags of ``python -m equivalence.run`` and their validation.
- ``store``: reading checkpoints (``legacy_pmap/checkpoints.py``, ``nnx_sharded/checkpoints.py``)
  with every failure turned into one line (``CheckpointError``, exit 2).
- ``layout``: a port's two train states as checkpoints hold them, built abstractly.
- ``migrate``: a legacy checkpoint -> an NNX one, through the port check's name mapping;
  ``python -m equivalence.checkpoint migrate`` is its command.
- ``resume``: the proof behind ``run --resume-at``: legacy saves, the checkpoint is migrated,
  NNX resumes from it, and the result is compared with legacy trained without stopping.

Importing this package imports no JAX.
"""
