"""Checkpoints of the NNX train state, through Orbax, restored straight onto the mesh.

Mirrors ``legacy_pmap/checkpoints.py`` function by function. Differences, each on purpose:

- Every process takes part in a save: each writes the shards it holds (a sharded array has
  no "replica 0" to unreplicate). The same layout otherwise: one directory per step, renamed
  into place when complete, items ``state``, ``rng`` and ``meta``.
- ``state`` is the NNX train state as a plain nested dict (``model``, ``optimizer`` with its
  ``step``, ``ema``), without random streams (``nnx.RngState``): a linen checkpoint never held
  them, and NNX re-seeds.
- A restore reads into a target of ``jax.ShapeDtypeStruct``s that carry the shardings
  (``nnx.get_abstract_model``), so each device reads its own shard from disk and nothing is
  gathered on one device first; the mesh may have another device count than the writer's.
"""

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

SAVED = nnx.Not(nnx.RngState)  # what a checkpoint holds: all but the random streams


class StateMismatch(ValueError):
    """A checkpoint whose leaves do not fit the train state it is restored into."""


def make_manager(directory: str, keep: int | None = None, preserve: Sequence[int] = ()) -> ocp.CheckpointManager:
    """Keeps the last ``keep`` steps (all when None) and every step in ``preserve``; synchronous
    (a save returns with the step on disk), as the legacy side."""
    policies = [ocp.checkpoint_managers.CustomSteps(list(preserve))]
    if keep is not None:
        policies.append(ocp.checkpoint_managers.LatestN(keep))
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False,
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies) if keep is not None else None,
    )
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save(manager: ocp.CheckpointManager, step: int, train_state: nnx.Module | dict, rng: jax.Array, meta=None) -> None:
    """The train state (an NNX object, or its ``state_dict``), with the host key chain."""
    state = train_state if isinstance(train_state, dict) else state_dict(train_state)
    items = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        rng=ocp.args.JaxRandomKeySave(_everywhere(rng)),
        meta=ocp.args.JsonSave({**(meta or {}), 'step': step}),
    )
    manager.save(step, args=items)


def state_dict(train_state: nnx.Module) -> dict:
    """What a checkpoint holds of a train state: a plain nested dict of its arrays."""
    return nnx.to_pure_dict(nnx.state(train_state, SAVED))


def _everywhere(x: jax.Array) -> jax.Array:
    """A value every process holds alike (the host key chain), as one array over every device of
    the run, so that Orbax writes it once; itself with one process."""
    if jax.process_count() == 1:
        return x
    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ('all',)), P())
    return jax.make_array_from_process_local_data(everywhere, np.asarray(x), np.shape(x))


def abstract_state(init_fn: Callable[[], nnx.Module], mesh: Mesh) -> tuple[Any, dict]:
    """``(graphdef, target)``: the train state's structure, and its ``state_dict`` as
    ``jax.ShapeDtypeStruct``s carrying the shardings its variables' metadata gives on ``mesh``
    (replicated where there is none: data parallelism). Nothing is allocated."""
    graphdef, abstract = nnx.get_abstract_model(init_fn, mesh)
    return graphdef, state_dict(nnx.merge(graphdef, abstract))


def spec(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{'optimizer/opt_state/0/mu/hidden/kernel': (shape, dtype)}`` of a state, a target or a checkpoint."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {path_str(path): (tuple(leaf.shape), str(np.dtype(leaf.dtype))) for path, leaf in leaves}


def path_str(path: tuple) -> str:
    """A pytree key path as ``'a/b/0/c'``: dict keys, list indices and namedtuple fields alike."""
    names = [next((getattr(k, a) for a in ('key', 'name', 'idx') if hasattr(k, a)), k) for k in path]
    return '/'.join(str(n) for n in names)


def first_mismatch(saved: dict, target: dict) -> str | None:
    """The first leaf, in the target's order, that the checkpoint lacks or holds with another
    shape or dtype; then the first leaf the target lacks. None when they fit."""
    for path, (shape, dtype) in target.items():
        if path not in saved:
            return f'{path}: not in the checkpoint (expected {list(shape)} {dtype})'
        if saved[path] != (shape, dtype):
            return f'{path}: checkpoint {list(saved[path][0])} {saved[path][1]}, expected {list(shape)} {dtype}'
    extra = next((p for p in saved if p not in target), None)
    return None if extra is None else f'{extra}: in the checkpoint, not in the train state ({list(saved[extra][0])})'


def open_step(directory: str, step: int | None = None) -> tuple[ocp.CheckpointManager, int]:
    """A read-only manager and the step to read: ``step``, or the latest. Orbax lists only
    finalised steps, so a directory a killed writer left behind is never one of them."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f'{directory} is not a directory')
    handlers = {
        'state': ocp.StandardCheckpointHandler(),
        'rng': ocp.JaxRandomKeyCheckpointHandler(),
        'meta': ocp.JsonCheckpointHandler(),
    }
    options = ocp.CheckpointManagerOptions(read_only=True)
    manager = ocp.CheckpointManager(os.path.abspath(directory), options=options, item_handlers=handlers)
    steps = manager.all_steps()
    if step is None and steps:
        step = max(steps)
    if step not in steps:
        found = ', '.join(map(str, sorted(steps))) or 'none'
        raise FileNotFoundError(f'no complete checkpoint of step {step} in {directory} (complete steps: {found})')
    return manager, step


def restore(directory: str, target: dict, step: int | None = None) -> tuple[dict, jax.Array, dict]:
    """``(state, rng, meta)``: the ``state_dict`` as arrays already placed as ``target`` says;
    ``load_into`` puts them into a train state. Raises ``StateMismatch`` (a ``ValueError``) naming
    the first leaf that does not fit ``target``."""
    manager, step = open_step(directory, step)
    mismatch = first_mismatch(spec(manager.item_metadata(step)['state']), spec(target))
    if mismatch is not None:
        raise StateMismatch(
            f'checkpoint {directory} step {step} does not fit this train state: first mismatching leaf {mismatch}'
        )
    items = ocp.args.Composite(
        state=ocp.args.StandardRestore(target),
        rng=ocp.args.JaxRandomKeyRestore(_on_host_device()),
        meta=ocp.args.JsonRestore(),
    )
    restored = manager.restore(step, args=items)
    return restored['state'], restored['rng'], dict(restored['meta'])


def load_into(train_state: nnx.Module, state: dict) -> None:
    """Restored arrays into a train state (or any object whose ``state_dict`` has their structure), in place."""
    current = nnx.state(train_state, SAVED)
    nnx.replace_by_pure_dict(current, state)
    nnx.update(train_state, current)


def _on_host_device() -> ocp.ArrayRestoreArgs:
    """The host key chain goes back where ``jax.random.split`` made it: this process's default device."""
    return ocp.ArrayRestoreArgs(sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))


def restore_train_state(directory: str, init_fn: Callable[[], nnx.Module], mesh: Mesh, step: int | None = None):
    """``(train_state, rng, meta)``: the train state ``init_fn`` builds, restored onto ``mesh``
    without building it. Its random streams, which a checkpoint does not hold, are the ones
    ``init_fn`` seeds: computed alone (XLA drops the unused parameter initialisers)."""
    graphdef, abstract = nnx.get_abstract_model(init_fn, mesh)
    train_state = nnx.merge(graphdef, abstract)
    state, rng, meta = restore(directory, state_dict(train_state), step)
    load_into(train_state, state)
    streams = nnx.state(train_state, nnx.RngState)
    if jax.tree.leaves(streams):
        placement = jax.tree.map(lambda leaf: leaf.sharding, streams)
        nnx.update(train_state, jax.jit(lambda: nnx.state(init_fn(), nnx.RngState), out_shardings=placement)())
    return train_state, rng, meta
