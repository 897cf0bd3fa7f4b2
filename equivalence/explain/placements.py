"""Where each input of a compiled call lives: leaf names by train-state group, and shardings.

Each path lays out its call's inputs its own way (``Layout``): pmap stacks one copy of the
state per device, the sharded call takes global arrays, a loop port's call takes its split
state first. ``placement`` reads one input's sharding into a ``Placement``.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from equivalence.core.state.paths import key_name
from equivalence.explain.measurements import Placement

LEGACY_GROUPS = {  # train state field -> group (the suite's TrainState, and the usual names of a user's)
    'step': 'step',
    'params': 'params',
    'opt_state': 'opt_state',
    'model_state': 'model_state',
    'batch_stats': 'model_state',
    'params_ema': 'ema',
    'ema_params': 'ema',
    'ema': 'ema',
}


def _legacy_leaf(keys: tuple[str, ...], kind: str) -> tuple[str, str]:
    """``((keys_D, pstate), batch_DxK)`` -> ``(group, name)``."""
    if keys[0] == '1':
        return 'batch', '/'.join(keys[1:])
    if keys[1] == '0':
        return 'keys', 'keys'
    return LEGACY_GROUPS.get(keys[2], 'other'), '/'.join(keys[2:])


def _nnx_leaf(keys: tuple[str, ...], kind: str) -> tuple[str, str]:
    """``((keys, state), batch_KxG)`` -> ``(group, name)``; ``kind`` is the NNX Variable type."""
    if keys[0] == '1':
        return 'batch', '/'.join(keys[1:])
    if keys[1] == '0':
        return 'keys', 'keys'
    rest = keys[2:]
    if rest[0] == 'model':
        return ('params' if kind == 'Param' else 'model_state'), '/'.join(rest)
    if rest[0] == 'ema':
        return 'ema', '/'.join(rest)
    return ('step' if rest == ('optimizer', 'step') else 'opt_state'), '/'.join(rest)


def _nnx_loop_leaf(keys: tuple[str, ...], kind: str) -> tuple[str, str]:
    """A loop port's ``(state, keys, batch_KxG)`` -> ``(group, name)``, by NNX Variable type."""
    if keys[0] == '2':
        return 'batch', '/'.join(keys[1:])
    if keys[0] == '1':
        return 'keys', 'keys'
    name = '/'.join(keys[1:])
    if kind == 'Param':
        return ('ema' if 'ema' in keys[1:-1] else 'params'), name
    if kind == 'BatchStat':
        return 'model_state', name
    if kind.startswith('Opt'):
        return ('step' if keys[-1] == 'step' else 'opt_state'), name
    return 'other', name


def flat_inputs(args: tuple, shardings: Any) -> list[tuple[tuple[str, ...], str, Any, Any]]:
    """``(path, NNX Variable type or '', array, sharding)`` for every input of the call."""
    import jax
    from flax import nnx

    is_var = lambda x: isinstance(x, nnx.Variable)
    flat, _ = jax.tree_util.tree_flatten_with_path(args, is_leaf=is_var)
    shards = jax.tree.leaves(shardings)
    if len(flat) != len(shards):
        raise ValueError(f'{len(flat)} inputs but {len(shards)} input shardings')
    out = []
    for (path, leaf), sharding in zip(flat, shards, strict=True):
        kind, array = (type(leaf).__name__, leaf[...]) if is_var(leaf) else ('', leaf)
        out.append((tuple(key_name(k) for k in path), kind, array, sharding))
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one path lays out the inputs of its fused call."""

    path: str  # 'legacy' or 'nnx'
    title: str
    leaf: Callable  # (path keys, NNX Variable type) -> (group, name)
    stacks_state: bool  # pmap: every state leaf is [D, ...], one whole copy per device
    example_axes: tuple[int, ...]  # the axes of a batch array that index examples


LEGACY = Layout('legacy', 'legacy pmap(scan)', _legacy_leaf, True, (0, 2))  # batch [D, K, B, ...]
NNX = Layout('nnx', 'NNX sharded scan', _nnx_leaf, False, (1,))  # batch [K, G, ...]
NNX_LOOP = Layout('nnx', "the port's NNX call", _nnx_loop_leaf, False, (1,))


def placement(group: str, name: str, array: Any, sharding: Any, layout: Layout) -> Placement:
    shape = tuple(np.shape(array))
    if layout.stacks_state:  # pmap: each process passes [its devices, ...]; the program's input is [D, ...]
        shape = (len(sharding.device_set), *shape[1:])
    return Placement(
        group=group,
        name=name,
        shape=shape,
        dtype=str(array.dtype),
        spec=tuple(getattr(sharding, 'spec', ())),
        mesh={str(k): int(v) for k, v in getattr(getattr(sharding, 'mesh', None), 'shape', {}).items()},
        devices=len(sharding.device_set),
        shard_shape=tuple(sharding.shard_shape(shape)),
        stacked=layout.stacks_state and group not in ('batch', 'keys'),
        example_axes=layout.example_axes if group == 'batch' else (),
        sharding=sharding,
    )


def copies_spread(arrays: list[Any]) -> float | None:
    """Max |device d's copy - device 0's copy| over arrays whose devices each hold a whole copy."""
    spreads = []
    for a in arrays:
        shards = [np.asarray(s.data, np.float64).ravel() for s in getattr(a, 'addressable_shards', [])]
        if len(shards) > 1 and len({s.size for s in shards}) == 1:
            spreads.append(max(float(np.abs(s - shards[0]).max(initial=0.0)) for s in shards))
    return max(spreads) if spreads else None
