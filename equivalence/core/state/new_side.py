"""A loop port's new side as teams write it: three forms of train state, each read here, at the port
boundary, so that nothing of them leaks into the harness.

- ``objects``: NNX graph nodes, ``(model, optimizer)`` or an object with ``.model`` and
  ``.optimizer`` (``convert.find_nnx_groups``), stepped by ``nnx.jit`` or split/merge;
- a flax ``TrainState`` (or subclass) whose ``params`` is an ``nnx.State`` and which carries a
  ``graphdef``: functional NNX under ``jax.jit``, as flax's own NNX examples write it;
- a plain pytree of linen parameters and optax state, a dict ``{'params', 'opt_state'}``, a tuple
  ``(params, opt_state)`` (as the pmap side reads one) or a ``TrainState``, stepped by linen under
  ``jax.jit``: no NNX at all.

The last two are ``pytree`` forms: the user's step gets them as they are (a plain array stays an
array; the pre-flight traces them with ``jax.eval_shape`` over the real pytree), and they are read
by field name or key as the pmap side's state is: ``params``, ``opt_state``, ``batch_stats`` or
``model_state``, an EMA, and the step counter where it lives (a ``step`` field, else the optimizer
state's own ``count``). ``nnx.State`` and ``nnx.Variable`` are unwrapped to dicts and arrays, so the
paths read ``fc1/kernel`` as the objects' do. ``new_groups=`` reads any other state.

``new_state`` is built from the NNX model holding linen's weights when the port has an
``nnx_model``, else from linen's variables themselves, as ``legacy_state`` is.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from equivalence.core.state import convert, states

OBJECTS, PYTREE = 'objects', 'pytree'
WHY = {
    'graphdef': "the model's structure (an nnx.GraphDef), not an array",
    'apply_fn': states.WHY['apply_fn'],
    'tx': states.WHY['tx'],
}


def form(train_state: Any) -> str:
    """``'objects'`` when the state holds NNX graph nodes (modules, optimizers), else ``'pytree'``."""
    nodes = jax.tree.leaves(train_state, is_leaf=lambda x: isinstance(x, nnx.Pytree))
    return OBJECTS if any(isinstance(x, nnx.Pytree) for x in nodes) else PYTREE


def source(port: Any, variables: dict, model: Any = None) -> Any:
    """What ``port.new_state`` takes: the NNX model holding linen's weights, or linen's variables."""
    return variables if port.nnx_model is None else model


def plain(tree: Any) -> Any:
    """``tree`` with every ``nnx.State`` a dict and every ``nnx.Variable`` its array."""

    def unwrap(x):
        if isinstance(x, nnx.State):
            return nnx.to_pure_dict(x)
        return x.get_value() if isinstance(x, nnx.Variable) else x

    return jax.tree.map(unwrap, tree, is_leaf=lambda x: isinstance(x, nnx.State | nnx.Variable))


def fields(train_state: Any) -> dict[str, Any] | None:
    """A pytree train state's fields by name: a dataclass (flax ``TrainState``), a namedtuple, a tuple
    ``(params, opt_state)``, a dict."""
    if dataclasses.is_dataclass(train_state) and not isinstance(train_state, type):
        return {f.name: getattr(train_state, f.name) for f in dataclasses.fields(train_state)}
    if hasattr(train_state, '_asdict'):
        return dict(train_state._asdict())
    if isinstance(train_state, tuple | list) and len(train_state) == 2:  # (params, opt_state), as the pmap side's
        return {'params': train_state[0], 'opt_state': train_state[1]}
    return dict(train_state) if isinstance(train_state, Mapping) else None


def read_groups(train_state: Any) -> dict[str, Any]:
    """The groups the comparison reads, from a new train state of any form (``new_groups=``'s default)."""
    if form(train_state) == OBJECTS:
        return convert.find_nnx_groups(train_state)
    named = fields(train_state)
    if named is not None and split_form(named):  # nnx.split((model, optimizer)) kept as (graphdef, state): merged back
        return convert.find_nnx_groups(nnx.merge(named['graphdef'], named['state']))
    if named is None or named.get('params') is None:
        given = sorted(named) if named is not None else type(train_state).__name__
        raise convert.UnreadableState(
            f"the new train state must be NNX objects (model, optimizer), hold 'params' and 'opt_state' "
            f'by field or key, or be a tuple (params, opt_state); got {given}: give the port new_groups='
        )
    get = lambda *names: next((named[n] for n in names if named.get(n) is not None), None)  # noqa: E731
    model_state = get('model_state')
    if model_state is None and get('batch_stats') is not None:
        model_state = {'batch_stats': named['batch_stats']}
    step = counter(named)
    return convert.as_parameters(plain({
        'params': named['params'],
        'opt_state': named.get('opt_state'),
        'ema': get('params_ema', 'ema_params', 'ema'),
        'model_state': model_state,
        'step': None if step is None else {'step': step[1]},
    }))  # fmt: skip


def split_form(named: dict[str, Any]) -> bool:
    """Whether a train state's fields are ``nnx.split((model, optimizer))`` kept as ``graphdef`` and ``state``."""
    split = isinstance(named.get('graphdef'), nnx.GraphDef) and named.get('state') is not None
    return split and named.get('params') is None


def counter(named: dict[str, Any]) -> tuple[str, Any] | None:
    """``(where, value)`` of the step counter: a ``step`` field, else the first integer ``count`` of the
    optimizer state (optax's Adam, schedules and clipping chains count their updates there)."""
    if named.get('step') is not None:
        return 'step', named['step']
    flat = jax.tree_util.tree_flatten_with_path(plain(named.get('opt_state')))[0]
    for path, leaf in flat:
        names = [convert.key_name(k) for k in path]
        dtype = getattr(leaf, 'dtype', None) or np.asarray(leaf).dtype
        if names and names[-1] == 'count' and np.issubdtype(dtype, np.integer):
            return 'opt_state/' + '/'.join(names), leaf
    return None


def not_compared(train_state: Any, groups=None) -> list[str]:
    """What the report says of the new train state: every field it does not read (by name, or, given the
    port's own ``groups``, every field none of whose arrays they hand on), and where the counter came from
    when the state has no ``step`` of its own."""
    if form(train_state) == OBJECTS:
        return states.nnx_not_compared(train_state)
    named = fields(train_state) or {}
    lines, read = [], states.read_by(groups and (lambda ts: plain(groups(ts))), train_state)
    merged = groups is None and split_form(named)  # its state is read, merged back with its graphdef (read_groups)
    by_field = {f.name: f for f in dataclasses.fields(train_state)} if dataclasses.is_dataclass(train_state) else {}
    for name, value in named.items():
        if read(name, value) or (merged and name == 'state'):
            continue
        if name in WHY:
            why = (states.Skip.STATIC, WHY[name])
        else:
            why = states.why_not_compared(by_field[name], value) if name in by_field else _why_key(value)
        lines.append(states.Uncompared(name, *why, side='new'))
    where = counter(named)
    if where is not None and where[0] != 'step':
        lines.append(f'step: the new train state has no step field; its counter is {where[0]}')
    return lines


def _why_key(value: Any) -> tuple[states.Skip, str]:
    n = len(jax.tree.leaves(value))
    return states.Skip.UNREAD, f'{type(value).__name__} ({n} arrays): no counterpart the suite reads (give new_groups=)'


def structure(train_state: Any) -> Any:
    """What a train state is apart from its arrays: a pytree's treedef, NNX objects' graphdef (with their static
    fields: an optax transformation ``new_state`` made, a TrainState's ``tx``)."""
    return jax.tree.structure(train_state) if form(train_state) == PYTREE else nnx.split(train_state)[0]


def restructured(train_state: Any, structure_: Any) -> Any:
    """``train_state``'s arrays under another setup's ``structure``: the team's call is one object that JAX's
    caches key by already, but by its state's static fields too, which ``new_state`` makes afresh; a setup
    built again (the twin of the run's own program) compiled the call again. Its own, where they differ."""
    try:
        if form(train_state) == PYTREE:
            return jax.tree.unflatten(structure_, jax.tree.leaves(train_state))
        return nnx.merge(structure_, nnx.split(train_state)[1])
    except Exception:  # noqa: BLE001 -- another structure: it keeps its own (and compiles its own)
        return train_state
