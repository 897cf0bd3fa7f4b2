"""Both frameworks' state <-> one neutral form: ``{group: {'a/b/c': np.ndarray}}``.

Linen and NNX initialisers split keys differently, so the harness initialises linen once
and copies the variables into the NNX model. Everything the comparison sees goes through
``legacy_to_neutral`` / ``nnx_to_neutral``; ``compare.py`` never sees a framework type.
"""

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from equivalence.core.state.paths import key_name, rename  # noqa: F401 -- rename: part of this module's API

Neutral = dict[str, dict[str, np.ndarray]]  # group ('params', 'opt_state', ...) -> path -> array


def flatten(tree: Any) -> dict[str, np.ndarray]:
    """``{'a/b/c': host array}``; optax namedtuple fields and NNX dict keys read alike."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {'/'.join(key_name(k) for k in path): host(leaf) for path, leaf in leaves}


def host(x: Any) -> np.ndarray:
    """``x`` as a host array; a typed key (``jax.random.key``, dtype ``key<fry>``) as its key data, the
    ``uint32`` array a raw key (``jax.random.PRNGKey``) is, so that the two read and compare alike."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def load_linen_variables(model: nnx.Module, variables: dict, mapping: dict[str, str] | None = None) -> None:
    """Copy linen variables (params and batch_stats) into an NNX model, leaf by leaf.

    ``mapping`` (``naming.resolve``) pairs every linen leaf path with its NNX path; it was
    checked against both models before this is called. None: the paths are the same.
    """
    by_path = {}
    for collection in variables.values():
        flat = flatten(dict(collection))
        by_path.update({(mapping or {}).get(p, p): np.asarray(leaf) for p, leaf in flat.items()})
    state = nnx.state(model)
    nested = {}
    for path, leaf in by_path.items():
        node = nested
        *parents, last = path.split('/')
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    nnx.replace_by_pure_dict(state, _int_keys(nested, nnx.to_pure_dict(state)))
    nnx.update(model, state)


def _int_keys(nested: dict, like: dict) -> dict:
    """Path strings back to the keys the NNX state uses (list indices are ints: ``layers/0``)."""
    out = {}
    for k, v in nested.items():
        key = next((c for c in like if str(c) == k), k)
        out[key] = _int_keys(v, like[key]) if isinstance(v, dict) else v
    return out


def legacy_to_neutral(state) -> Neutral:
    """A single-replica ``legacy_pmap.train.TrainState``, or any train state with the same field names."""
    return groups_to_neutral(legacy_groups(state))


def legacy_groups(state) -> dict[str, Any]:
    """A pmap-era train state's fields by group: ``step``, ``params``, ``opt_state``, and where
    present ``model_state`` or ``batch_stats``, and ``params_ema`` (also ``ema_params``, ``ema``).
    A dict with those keys (linen + ``jax.jit`` code keeps ``{'params': ..., 'opt_state': ...}``) reads
    alike; a state with no counter gives ``step`` None."""
    get = state.get if isinstance(state, Mapping) else lambda name: getattr(state, name, None)
    field = lambda *names: next((get(n) for n in names if get(n) is not None), None)  # noqa: E731
    for name in ('params', 'opt_state'):
        if get(name) is None:
            raise AttributeError(f'{type(state).__name__} has no {name!r}: give the port legacy_groups=')
    model_state = field('model_state')
    if model_state is None and field('batch_stats') is not None:
        model_state = {'batch_stats': get('batch_stats')}
    return as_parameters({
        'params': get('params'),
        'opt_state': get('opt_state'),
        'ema': field('params_ema', 'ema_params', 'ema'),
        'model_state': model_state,
        'step': {'step': get('step')} if get('step') is not None else None,
    })  # fmt: skip


def as_parameters(groups: dict[str, Any]) -> dict[str, Any]:
    """``groups`` read from a state whose ``params`` is linen's whole variables, ``{'params': ...}`` (its only
    key: ``TrainState.create(params=variables)``), with that level taken off its parameters, its EMA and its
    optimizer state, where Adam's ``mu`` and ``nu`` hold it too; any other groups as they are."""
    if not _wrapped(groups.get('params')):
        return groups
    unwrap = lambda tree: jax.tree.map(lambda x: x['params'] if _wrapped(x) else x, tree, is_leaf=_wrapped)  # noqa: E731
    return {**groups, **{g: unwrap(groups[g]) for g in ('params', 'ema', 'opt_state') if groups.get(g) is not None}}


def _wrapped(tree: Any) -> bool:
    return isinstance(tree, Mapping) and list(tree) == ['params'] and isinstance(tree['params'], Mapping)


def groups_to_neutral(groups: dict[str, Any]) -> Neutral:
    return {group: flatten(tree) for group, tree in groups.items()}


def nnx_to_neutral(graphdef, state) -> Neutral:
    """The split ``nnx_sharded.train.TrainState``, grouped and named as the linen side."""
    ts = nnx.merge(graphdef, state)
    return groups_to_neutral(nnx_groups(ts.model, ts.optimizer, ts.ema))


def nnx_groups(model: nnx.Module, optimizer: nnx.Optimizer, ema: nnx.Module | None = None) -> dict[str, Any]:
    """An NNX model, its ``nnx.Optimizer`` and an optional EMA copy, by group."""
    stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    return {
        'params': nnx.to_pure_dict(nnx.state(model, nnx.Param)),
        'opt_state': nnx.to_pure_dict(nnx.state(optimizer.opt_state)),
        'ema': nnx.to_pure_dict(nnx.state(ema, nnx.Param)) if ema is not None else None,
        'model_state': {'batch_stats': stats} if stats else {},
        'step': {'step': optimizer.step[...]},
    }


def find_nnx_groups(train_state: Any) -> dict[str, Any]:
    """The groups of a user's NNX train state: ``(model, optimizer)``, or an object with
    ``model``, ``optimizer`` and optionally ``ema`` attributes."""
    return nnx_groups(*find_nnx_objects(train_state))


class UnreadableState(TypeError):
    """A new train state the suite cannot read by itself: the port is to give ``new_groups=``."""


def find_nnx_objects(train_state: Any) -> tuple[nnx.Module, nnx.Optimizer, nnx.Module | None]:
    """``(model, optimizer, ema or None)`` of a user's NNX train state, shaped as ``find_nnx_groups`` reads it."""
    if isinstance(train_state, tuple | list):
        objects = list(train_state)
    else:
        objects = [getattr(train_state, a) for a in ('model', 'optimizer') if hasattr(train_state, a)]
    optimizers = [o for o in objects if isinstance(o, nnx.Optimizer)]
    models = [o for o in objects if isinstance(o, nnx.Module) and not isinstance(o, nnx.Optimizer)]
    if len(optimizers) != 1 or len(models) != 1:
        raise UnreadableState(
            'the NNX train state must be (model, optimizer) or have .model and .optimizer; '
            f'got {type(train_state).__name__}: give the port new_groups='
        )
    return models[0], optimizers[0], getattr(train_state, 'ema', None)
