"""A port's two train states as their checkpoints hold them, built without allocating either.

The legacy side is the train state the port's pmap loop carries (the suite's
``legacy_pmap.train.TrainState`` for a model port, the user's own for a loop port). The NNX
side is laid out as ``nnx_sharded.train.TrainState`` is: ``model`` (parameters and batch
statistics), ``optimizer`` (its ``opt_state`` and ``step``) and ``ema``; a loop port's own
objects are viewed under those names (``run.setups.View``), so one checkpoint layout serves both
levels. What each kind of port builds is its kind's (``core.kinds``: ``legacy_train_state``,
``checkpoint_state``; a setup's ``view``).
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from equivalence.core import kinds
from equivalence.core.port.ports import Port, init_inputs
from equivalence.core.run.setups import View  # noqa: F401 -- a loop port's objects under TrainState's names
from equivalence.core.state import states
from nnx_sharded import checkpoints as nnx_checkpoints


def _variables(port: Port) -> dict:
    """The linen variables, initialised from one example as the harness does."""
    data = port.make_data(np.random.default_rng(0), 1, 1)
    example = jax.tree.map(lambda v: v[0, :1], data)
    key = jax.random.PRNGKey(0)
    args, kwargs = init_inputs(port, example)
    return dict(port.legacy_model().init({'params': key, 'dropout': key}, *args, **kwargs))


def legacy_init(port: Port) -> Callable[[], Any]:
    """A function building the port's legacy train state (one replica)."""
    kind = kinds.of(port)
    return lambda: kind.legacy_train_state(_variables(port))


def nnx_init(port: Port) -> Callable[[], nnx.Module]:
    """A function building the port's NNX train state, laid out as ``nnx_sharded.train.TrainState``;
    a loop port with ``new_groups=`` keeps its own layout (``group_places`` maps into it)."""
    return kinds.of(port).checkpoint_state


def view(setup: Any) -> nnx.Module:
    """The NNX train state a harness setup trains, as one object (``setup.view``)."""
    return setup.view()


class _Marker(jax.ShapeDtypeStruct):
    """An abstract leaf with an identity: ``v[...]`` of a Variable holding it gives it back."""

    def __getitem__(self, index):
        return self


def group_places(port: Port) -> dict[str, str] | None:
    """For a loop port with ``new_groups=``: ``{'params/fc1/kernel': 'net/fc1/kernel'}``, where each
    leaf its groups read lives in its own train state's checkpoint. Found without allocating: each
    abstract leaf is a distinct marker, and the groups hand the markers back. None without new_groups."""
    if port.new_groups is None:
        return None
    train_state = nnx.eval_shape(nnx_init(port))
    state = nnx.state(train_state, nnx_checkpoints.SAVED)
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    markers = {nnx_checkpoints.path_str(p): _Marker(leaf.shape, leaf.dtype) for p, leaf in flat}
    nested = jax.tree_util.tree_unflatten(jax.tree.structure(nnx.to_pure_dict(state)), list(markers.values()))
    nnx.replace_by_pure_dict(state, nested)
    nnx.update(train_state, state)
    where = {id(m): path for path, m in markers.items()}
    groups = port.new_groups(train_state)
    leaves = jax.tree_util.tree_flatten_with_path({g: t for g, t in groups.items() if t is not None})[0]
    return {nnx_checkpoints.path_str(p): where[id(m)] for p, m in leaves if id(m) in where}


def legacy_groups(port: Port) -> Callable[[Any], dict]:
    """One replica of the port's legacy train state -> ``{group: tree}``, as the comparison reads it."""
    return port.legacy_groups or states.legacy_groups
