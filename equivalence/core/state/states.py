"""Train states as teams wrote them, read into the comparison's groups, and what is left out, said.

The pmap side is read by field name (``convert.legacy_groups``): a flax
``training.train_state.TrainState`` and its subclasses (``batch_stats``, an EMA as
``ema_params`` / ``params_ema`` / ``ema``) need no ``legacy_groups=``, nor does a dict with those
keys (linen + ``jax.jit``: ``{'params': ..., 'opt_state': ...}``), and a plain tuple
``(params, opt_state)`` is read as those two. Whatever else a state holds is listed in the
report as ``not compared: <field>: <why>``, never dropped without a word: static fields
(``apply_fn``, ``tx``), a ``dynamic_scale`` (mixed-precision bookkeeping with no NNX
counterpart), keys, and any field the suite has no NNX counterpart for. The NNX side is
listed the same way: variables that are neither parameters nor batch statistics.
"""

import dataclasses
import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import numpy as np
from flax import nnx

from equivalence.core.state import convert
from equivalence.core.state.line import Line

READ = ('step', 'params', 'opt_state', 'model_state', 'batch_stats', 'params_ema', 'ema_params', 'ema')
WHY = {
    'apply_fn': 'a static field (the model function), not an array',
    'tx': 'a static field (the optax transformation), not an array; its state is opt_state, compared',
}


class Skip(enum.StrEnum):
    """Why a field of a train state (or a metric) is not compared."""

    STATIC = 'static'  # a static field (the model function, the optax transformation), not an array
    UNSET = 'unset'  # None in this run
    LOSS_SCALE = 'loss scale'  # flax DynamicScale: mixed-precision bookkeeping the NNX side does not keep
    KEY = 'key'  # a random key, not trained state
    UNREAD = 'unread'  # arrays with no counterpart the suite reads (legacy_groups=, new_groups= would map them)
    NNX_VARIABLES = 'nnx variables'  # NNX variables that are neither parameters nor batch statistics
    NNX_RNG = 'nnx rng'  # NNX rng streams: the suite bridges the masks they draw instead
    NO_STEP = 'no step'  # one side's train state holds no step counter
    ONE_SIDE = 'one side'  # a metric only one side's step reports
    PER_DEVICE = 'per device'  # a metric that differs between pmap devices: not global on the pmap side
    EXTRA_OUTPUT = 'extra output'  # what a step returns after (state, out): (state, metrics, logs)'s logs


class Uncompared(Line):
    """``not compared: <subject>: <why>``: a line of the report, and a value (``subject``, ``skip``, ``side``)."""

    FIELDS = ('subject', 'skip', 'side')

    def __new__(cls, subject: str, skip: Skip, words: str, side: str = ''):
        text = f'not compared: {subject}: {words}' + (' (new side)' if side == 'new' else '')
        return super().__new__(cls, text, subject, Skip(skip), side)


def legacy_groups(state: Any) -> dict[str, Any]:
    """One replica of a pmap-era train state by group; a tuple is ``(params, opt_state)``."""
    if isinstance(state, tuple | list) and not hasattr(state, '_fields'):
        if len(state) != 2:
            raise TypeError(f'a tuple train state is (params, opt_state); got {len(state)} items: give legacy_groups=')
        return convert.as_parameters({'params': state[0], 'opt_state': state[1], 'step': None})
    return convert.legacy_groups(state)


def legacy_not_compared(state: Any, groups=None) -> list[str]:
    """``not compared: <field>: <why>`` for every field (or key, of a dict) of a pmap-era train state
    the groups do not read: by name, or, where the port gives its own ``groups`` (``legacy_groups=``),
    every field none of whose arrays the groups hand on."""
    read = read_by(groups, state)
    if isinstance(state, Mapping):
        return [Uncompared(str(k), *_why(str(k), v)) for k, v in state.items() if not read(str(k), v)]
    if not dataclasses.is_dataclass(state):
        return []
    lines = []
    for field in dataclasses.fields(state):
        if read(field.name, getattr(state, field.name)):
            continue
        value = getattr(state, field.name)
        lines.append(Uncompared(field.name, *_why(field.name, value, field.metadata)))
    return lines


def read_by(groups, state: Any):
    """``(name, value) -> whether the comparison reads it``: by name (``READ``), or, given the port's own
    ``groups``, whether they hand on an array of it (the same objects: groups pick fields, they do not copy)."""
    if groups is None:
        return lambda name, value: name in READ
    handed = {id(x) for x in jax.tree.leaves(groups(state))}
    return lambda name, value: any(id(x) in handed for x in jax.tree.leaves(value))


def _why(name: str, value: Any, metadata: Mapping = MappingProxyType({})) -> tuple[Skip, str]:
    """``(why, in words)`` a field of a train state is not compared."""
    if name in WHY:
        return Skip.STATIC, WHY[name]
    if not metadata.get('pytree_node', True):
        return Skip.STATIC, f'a static field ({type(value).__name__}), not an array'
    if value is None:
        return Skip.UNSET, 'None in this run'
    if type(value).__name__ == 'DynamicScale':
        scale = np.asarray(jax.device_get(value.scale)).reshape(-1)[:1]
        return Skip.LOSS_SCALE, (f'flax DynamicScale (loss scale {float(scale[0]):g}): mixed-precision bookkeeping; '
                                 'the NNX side keeps no loss scale to compare it with')  # fmt: skip
    if 'rng' in name or 'key' in name:
        return Skip.KEY, 'a random key, not trained state: the masks drawn from it are bridged, not its bits'
    n = len(jax.tree.leaves(value))
    return Skip.UNREAD, (f'{type(value).__name__} ({n} arrays): no NNX counterpart the suite reads (give '
                         'legacy_groups=, new_groups=)')  # fmt: skip


def nnx_not_compared(train_state: Any) -> list[str]:
    """NNX variables in the user's train state that are neither parameters, batch statistics, nor optimizer state."""
    try:
        model = convert.find_nnx_objects(train_state)[0]
    except TypeError:
        return []
    counts: dict[str, int] = {}
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and not isinstance(node, nnx.Param | nnx.BatchStat):
            name = type(node).__name__
            counts[name] = counts.get(name, 0) + 1
    rng = {k: counts.pop(k) for k in ('RngKey', 'RngCount') if k in counts}
    lines = [Uncompared(f'NNX {name} variables ({n})', Skip.NNX_VARIABLES, 'neither parameters nor batch statistics')
             for name, n in counts.items()]  # fmt: skip
    if rng:
        lines.append(Uncompared(f'NNX rng streams ({sum(rng.values())} keys and counters)', Skip.NNX_RNG,
                                'the suite bridges the masks they draw instead'))  # fmt: skip
    return lines


def align(ref: convert.Neutral, other: convert.Neutral, mapped: bool = False):
    """``(ref, other, notes)``: a ``step`` counter that one side's state does not hold is left out on both, and
    said; ``mapped``: the port's own groups (``legacy_groups``) read the pmap side, and hold none."""
    if bool(ref.get('step')) == bool(other.get('step')):
        return ref, other, []
    side = 'pmap' if not ref.get('step') else 'NNX'
    held = 'holds no step counter'
    why = (f"the {side} side's groups (the port's legacy_groups / new_groups) hold no step counter: map it as "
           "'step' to compare it" if mapped else f"the {side} train state {held} (a tuple (params, opt_state), "
           "a dict with no 'step', or a state with no step field)")  # fmt: skip
    return without(ref, 'step'), without(other, 'step'), [Uncompared('step', Skip.NO_STEP, why)]


def without(neutral: convert.Neutral, group: str) -> convert.Neutral:
    return {g: t for g, t in neutral.items() if g != group}


def why_not_compared(field: dataclasses.Field, value: Any) -> tuple[Skip, str]:
    """``(why, in words)`` a dataclass field of a train state is not compared (``new_side`` reads the new side's
    by it)."""
    return _why(field.name, value, field.metadata)
