"""Checkpoints that teams wrote with their own code, read as the suite reads its own.

Three layouts are recognised, beside the suite's own (``legacy_pmap/checkpoints.py``: a step
directory holding ``state``, ``rng`` and ``meta`` items):

- ``flax.training.checkpoints.save_checkpoint`` (Orbax-backed): ``<dir>/checkpoint_<step>/``, one pytree;
- an ``orbax.checkpoint.CheckpointManager`` saving one item: ``<dir>/<step>/<item>/`` (``default``,
  or ``state``, ``train_state`` ...), one pytree;
- an ``orbax.checkpoint.StandardCheckpointer`` / ``PyTreeCheckpointer``: ``<dir>/`` is the pytree itself.

The pytree is read through Orbax's own metadata, without a target (host arrays; optax's
namedtuples come back as dicts, tuples as lists), checked leaf by leaf against the port's train
state (``first_mismatch``: exit 2 naming the leaf), then placed into that typed state by path, as
``legacy_pmap.checkpoints.restore`` does. A flax ``TrainState`` or a plain dict reads alike. Such
checkpoints hold no host key chain: the resumed run recomputes it from the seed
(``adapters.chain_at``), and the migrated checkpoint records that it did.
"""

import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from legacy_pmap import checkpoints as legacy_checkpoints

FLAX_STEP = re.compile(r'^checkpoint_(\d+)$')


def _is_pytree(path: str) -> bool:
    return os.path.isfile(os.path.join(path, '_METADATA'))


def _steps(directory: str) -> dict[int, str]:
    """``{step: pytree directory}`` of a flax or CheckpointManager layout (finalised steps only)."""
    found = {}
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        flax = FLAX_STEP.match(name)
        if flax and _is_pytree(path):
            found[int(flax.group(1))] = path
        elif name.isdigit() and os.path.isdir(path):
            names = set(os.listdir(path))
            items = sorted(i for i in names if _is_pytree(os.path.join(path, i)))
            if len(items) == 1 and not {'state', 'meta'} <= names:  # the suite's own: state, rng and meta
                found[int(name)] = os.path.join(path, items[0])
    return found


def locate(directory: str, step: int | None) -> tuple[str, str, int | None] | None:
    """``(layout, pytree directory, step)`` of a team's checkpoint, or None for the suite's own layout."""
    if not os.path.isdir(directory):
        return None
    if _is_pytree(directory):
        return 'orbax StandardCheckpointer', directory, step
    steps = _steps(directory)
    if not steps:
        return None
    layout = 'flax save_checkpoint' if any(FLAX_STEP.match(os.path.basename(p)) for p in steps.values()) else (
        'orbax CheckpointManager')  # fmt: skip
    step = max(steps) if step is None else step
    if step not in steps:
        found = ', '.join(map(str, sorted(steps)))
        raise FileNotFoundError(f'no complete checkpoint of step {step} in {directory} ({layout}; steps: {found})')
    return layout, steps[step], step


def read(directory: str, target: Any, step: int | None) -> tuple[Any, None, dict]:
    """``(state, None, meta)`` of a team's checkpoint, typed as ``target`` (the port's legacy train state)."""
    layout, path, step = locate(directory, step)
    checkpointer = ocp.PyTreeCheckpointer()
    saved = checkpointer.metadata(path).item_metadata.tree
    mismatch = legacy_checkpoints.first_mismatch(legacy_checkpoints.spec(saved), legacy_checkpoints.spec(target))
    if mismatch is not None:
        raise legacy_checkpoints.StateMismatch(
            f"checkpoint {path} ({layout}) does not fit the port's train state: first mismatching leaf {mismatch}"
        )
    restored = checkpointer.restore(path)
    flat = {legacy_checkpoints.path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]}
    state = jax.tree_util.tree_map_with_path(lambda p, _: np.asarray(flat[legacy_checkpoints.path_str(p)]), target)
    if step is None:  # a bare pytree: its step is the state's own
        step = int(np.asarray(flat.get('step', 0)))
    return state, None, {'step': step, 'source_layout': layout, 'rng_recorded': False}
