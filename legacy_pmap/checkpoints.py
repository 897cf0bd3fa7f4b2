"""Checkpoints as pmap-era code wrote them, through Orbax.

score_sde saved ``flax_utils.unreplicate(pstate)`` every ``snapshot_freq`` steps, with the host
key chain beside it, so that a restarted run draws the keys the first one would have drawn.
The same here with Orbax's ``CheckpointManager`` in its standard layout: one directory per
step, written under a temporary name and renamed when complete (a killed writer leaves nothing
that reads as a checkpoint), the last ``keep`` kept. Each step holds three items: ``state``
(the unreplicated ``TrainState``), ``rng`` (the host key chain after the step) and ``meta``
(JSON: the step, and whatever the caller records).

One process saves host arrays, replica 0. Several processes save as flax's multi-host pmap
examples do (``save_checkpoint_multiprocess``): every process calls ``save``, each leaf becomes
a global array replicated over every device of the run
(``ocp.utils.fully_replicated_host_local_array_to_global_array``), Orbax writes each leaf once,
from process 0, and renames the step into place only once every process has finished: a
process killed during a save leaves the step unfinished, and the previous one the newest
complete. The directory must be one that every process sees (a shared file system).
``nnx_sharded/checkpoints.py`` mirrors this file function by function.
"""

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from legacy_pmap.train import TrainState, replicate, unreplicate


class StateMismatch(ValueError):
    """A checkpoint whose leaves do not fit the train state it is restored into."""


def make_manager(directory: str, keep: int | None = None, preserve: Sequence[int] = ()) -> ocp.CheckpointManager:
    """Keeps the last ``keep`` steps (all when None) and every step in ``preserve``; synchronous,
    as the old ``save_checkpoint`` was. Every process makes one (Orbax's barriers span them all)."""
    policies = [ocp.checkpoint_managers.CustomSteps(list(preserve))]
    if keep is not None:
        policies.append(ocp.checkpoint_managers.LatestN(keep))
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False,
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies) if keep is not None else None,
    )
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save(manager: ocp.CheckpointManager, step: int, pstate: TrainState, rng: jax.Array, meta=None) -> None:
    """Replica 0 of the replicated state, with the host key chain; every process calls it."""
    items = ocp.args.Composite(
        state=ocp.args.StandardSave(state_dict(pstate)),
        rng=ocp.args.JaxRandomKeySave(_everywhere(rng)),
        meta=ocp.args.JsonSave({**(meta or {}), 'step': step}),
    )
    manager.save(step, args=items)


def state_dict(pstate: TrainState) -> TrainState:
    """What a checkpoint holds of the replicated state: replica 0, as host arrays; with several
    processes, as global arrays replicated over every device (the pmap spans them all)."""
    if jax.process_count() == 1:
        return jax.device_get(unreplicate(pstate))
    return jax.tree.map(ocp.utils.fully_replicated_host_local_array_to_global_array, pstate)


def _everywhere(x: jax.Array) -> jax.Array:
    """A value every process holds alike (the host key chain), as one array over every device of
    the run, so that Orbax writes it once; itself with one process."""
    if jax.process_count() == 1:
        return x
    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ('all',)), P())
    return jax.make_array_from_process_local_data(everywhere, np.asarray(x), np.shape(x))


def abstract_state(make_state: Callable[[], TrainState]) -> TrainState:
    """The train state's shapes and dtypes, nothing allocated: the target a restore fills.
    A typed target is what brings optax's namedtuples back as namedtuples."""
    return jax.eval_shape(make_state)


def spec(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{'opt_state/0/mu/hidden/kernel': (shape, dtype)}`` of a state, its target or a checkpoint's metadata."""
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


def restore(directory: str, target: TrainState, step: int | None = None) -> tuple[TrainState, jax.Array, dict]:
    """``(state, rng, meta)``: the unreplicated state as host arrays, typed as ``target``; then
    ``load_into`` puts it back on the devices. Raises ``StateMismatch`` (a ``ValueError``) naming
    the first leaf that does not fit ``target``. Read as saved, then placed into ``target`` leaf by leaf: a state
    whose leaves fit restores whatever empty fields (``None``, ``{}``) either side carries."""
    manager, step = open_step(directory, step)
    saved = manager.item_metadata(step)['state']
    mismatch = first_mismatch(spec(saved), spec(target))
    if mismatch is not None:
        raise StateMismatch(
            f'checkpoint {directory} step {step} does not fit this train state: first mismatching leaf {mismatch}'
        )
    items = ocp.args.Composite(
        state=ocp.args.StandardRestore(jax.tree.map(_on_this_process, saved)),
        rng=ocp.args.JaxRandomKeyRestore(_on_host_device()),
        meta=ocp.args.JsonRestore(),
    )
    restored = manager.restore(step, args=items)
    flat = {path_str(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(restored['state'])[0]}
    state = jax.tree_util.tree_map_with_path(lambda path, _: np.asarray(flat[path_str(path)]), target)
    return state, restored['rng'], dict(restored['meta'])


def load_into(state: TrainState, devices) -> TrainState:
    """A restored state back on the devices, one copy each, as ``flax_utils.replicate`` did after a restore."""
    return replicate(state, devices)


def restore_train_state(directory: str, make_state: Callable[[], TrainState], devices, step: int | None = None):
    """``(pstate, rng, meta)``: the train state ``make_state`` builds, restored and replicated
    onto ``devices``, ready for the pmapped step."""
    state, rng, meta = restore(directory, abstract_state(make_state), step)
    return load_into(state, devices), rng, meta


def _on_this_process(leaf: Any) -> np.ndarray:
    """Each leaf read whole into host memory, whatever devices wrote it: a checkpoint saved by
    several processes names devices this process may not have. (A ``numpy`` leaf in the target
    is Orbax's way to ask for host arrays; its values are not read.)"""
    return np.empty(leaf.shape, leaf.dtype)


def _on_host_device() -> ocp.ArrayRestoreArgs:
    """The host key chain goes back where ``jax.random.split`` made it: this process's default device."""
    return ocp.ArrayRestoreArgs(sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
