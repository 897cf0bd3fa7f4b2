"""The shape of each group the comparison reads, checked on what a port's train state or its own
``legacy_groups=`` / ``nnx_groups=`` give, with the expected shape in the line (exit 2, before training).

Both sides' groups are flattened to paths and paired by name (``compare``): a counter given bare on
one side (``'step': state.step``) and as ``{'step': state.step}`` on the other is ``step/`` against
``step/step``, two one-sided leaves after the whole run. So each group has one shape:

- ``step``: ``{'step': counter}``, one scalar (or None: no counter; the report says so);
- ``model_state``: linen's collections by name, ``{'batch_stats': {...}}`` (or None / ``{}``);
- ``params``: the model's parameters, checked against the model (``groups._check_params``).
"""

from collections.abc import Mapping
from typing import Any

import jax

from equivalence.core.port.ports import Port
from equivalence.core.preflight.errors import fail

STEP = "{'step': counter}"


def check_shapes(port: Port, field: str, groups: Mapping, collections: set[str]) -> None:
    """``PreflightError`` naming ``field`` for the first group of another shape than the comparison reads;
    ``collections``: the linen variables' collections other than ``params`` (``batch_stats``)."""
    step = groups.get('step')
    if step is not None and not (isinstance(step, Mapping) and set(step) == {'step'} and _one_leaf(step['step'])):
        raise fail(port, field, f'gives step as {_shape(step)}; expected the step group as {STEP}, one scalar '
                                '(None when the state keeps no counter)')  # fmt: skip
    model_state = groups.get('model_state')
    if model_state and not (isinstance(model_state, Mapping) and set(model_state) <= collections):
        known = ', '.join(f"'{c}': {{...}}" for c in sorted(collections)) or "'batch_stats': {...}"
        raise fail(port, field, f"gives model_state as {_shape(model_state)}; expected linen's collections by "
                                f'name, {{{known}}} (None when the model has none)')  # fmt: skip


def _one_leaf(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree)
    return len(leaves) == 1 and int(getattr(leaves[0], 'size', 1)) == 1


def _shape(value: Any) -> str:
    if isinstance(value, Mapping):
        return f'a dict with keys {sorted(map(str, value))}'
    if hasattr(value, 'shape'):
        return f'an array of shape {list(value.shape)}'
    return f'a {type(value).__name__}'
