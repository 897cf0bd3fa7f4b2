"""What the comparison reads: both train states grouped, with the parameters where expected."""

from typing import Any

import jax

from equivalence.core.port import naming
from equivalence.core.port.ports import LoopPort, Port
from equivalence.core.preflight.errors import HOST_ONLY, fail, raised
from equivalence.core.preflight.shapes import check_shapes
from equivalence.core.preflight.trace import as_traced
from equivalence.core.state import convert, new_side


def check_groups(
    port: LoopPort, legacy_state: Any, nnx_ts: Any, variables: dict, mapping: dict, reader=convert.legacy_groups
) -> None:
    """Both train states grouped as the comparison reads them, with the parameters where expected and
    every group of its shape (``shapes``); ``mapping``: the names paired (linen -> NNX); ``reader``: the
    legacy side's default (a step form's reads tuples)."""
    legacy = check_legacy_groups(port, legacy_state, variables, reader)
    groups = check_new_state_groups(port, nnx_ts, variables, mapping)
    if legacy is not None and groups is not None:
        _check_opt_states(port, 'new_groups' if port.new_groups else 'new_state', legacy, groups)


def check_legacy_groups(port: Port, legacy_state: Any, variables: dict, reader=convert.legacy_groups) -> dict | None:
    """The pmap side's train state grouped as the comparison reads it (``check_groups``' first half, all that a
    recording checks: it never builds the new side); the groups, None where reading them runs host code."""
    groups = legacy_groups(port, legacy_state, reader)
    if groups is not None:
        field = 'legacy_groups' if port.legacy_groups else 'legacy_state'
        _check_params(port, field, groups, _params(variables))
        check_shapes(port, field, groups, set(variables) - {'params'})
    return groups


def check_new_state_groups(port: Port, nnx_ts: Any, variables: dict, mapping: dict) -> dict | None:
    """The new train state grouped as the comparison reads it (``check_groups``' second half, all that a check
    against a reference checks: its pmap side was recorded); the groups, None where reading them runs host code."""
    field = 'new_groups' if port.new_groups else 'new_state'
    groups = new_groups(port, nnx_ts, field)
    if groups is not None:
        _check_params(port, field, groups, {mapping.get(p, p) for p in _params(variables)})
        check_shapes(port, field, groups, set(variables) - {'params'})
    return groups


def _params(variables: dict) -> set[str]:
    return {p for p, (c, _, _) in naming.linen_spec(variables).items() if c == 'params'}


def _check_opt_states(port: Port, field: str, legacy: dict, new: dict) -> None:
    """Both optimizer states of one structure: slots in common (``0/mu``, ``1/0/trace``, ``0/count``: each
    leaf's path up to the parameters' tree it follows), else no leaf pairs and every one is compared on one
    side only (a ``chain(clip, adam)`` against a bare adam: the same arithmetic, a MISMATCH of bookkeeping).
    A port error, said before training, with the fix; and so are slots that differ in part (a schedule's count
    on one side only, google-research/vdm's port tried blind: a MISMATCH of bookkeeping, exit 1, after the
    whole run)."""
    if not isinstance(legacy, dict) or not isinstance(new, dict) or 'opt_state' not in legacy or 'opt_state' not in new:
        return
    old, now = _slots(legacy['opt_state'], legacy['params']), _slots(new['opt_state'], new['params'])
    shown = lambda slots: ', '.join(sorted(slots)[:6]) + (f' and {len(slots) - 6} more' if len(slots) > 6 else '')  # noqa: E731
    if old & now and old != now:  # in part: what one side alone holds is compared with nothing (bookkeeping)
        sides = (('new', now - old), ('pmap', old - now))
        one_side = [f'only on the {side} side: {shown(slots)}' for side, slots in sides if slots]
        raise fail(
            port,
            field,
            f"gives an optimizer state whose slots are not the pmap side's ({'; '.join(one_side)}): those leaves "
            "would be compared with nothing, though the numbers may train alike (a schedule's count: "
            'optax.adamw(learning_rate=schedule) keeps one, a float learning rate none); fix: build the same optax '
            "transformation on both sides, or give new_groups= (or legacy_groups=) whose 'opt_state' leaves it out",
        )
    if not old or not now or old & now:
        return
    names = lambda slots: {s.rpartition('/')[2] for s in slots}  # noqa: E731
    if names(old) & names(now):  # the same slots, nested otherwise: one transformation wrapped in a chain
        what, example = 'another structure', 'an optax.chain(clip, adam) against a bare adam, say'
    else:  # no slot of one name: another optimizer (SGD's trace against Adam's mu and nu)
        what, example = 'another optimizer', 'no slot of the same name on both sides'
    raise fail(
        port,
        field,
        f"gives an optimizer state of {what} than the pmap side's, so none of its leaves pair: "
        f'the pmap side holds {shown(old)}, the new side {shown(now)} ({example}); fix: build the same optax '
        "transformation on both sides, or give new_groups= (or legacy_groups=) whose 'opt_state' reads the part "
        'that corresponds (opt_state[1], say)',
    )


def _slots(tree: Any, params: Any) -> set[str]:
    """The slots of an optimizer state: each leaf's path up to the first key of the parameters' own tree."""
    top = {convert.key_name(path[0]) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0] if path}
    slots = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [convert.key_name(k) for k in path]
        at = next((i for i, name in enumerate(names) if name in top), len(names))
        slots.add('/'.join(names[:at]))
    return slots


def check_new_groups(port: LoopPort, ts: Any, variables: dict, mapping: dict) -> None:
    """The new train state alone (a step form traces it as the adapter builds it)."""
    field = 'new_groups' if port.new_groups else 'new_state'
    groups = new_groups(port, ts, field)
    if groups is not None:
        _check_params(port, field, groups, {mapping.get(p, p) for p in _params(variables)})


def new_groups(port: LoopPort, ts: Any, field: str) -> dict | None:
    """The new train state's groups (abstract), in whatever form (``new_side``), shapes only; None when
    reading them runs host code."""
    state, rebuild = as_traced(ts)
    fn = port.new_groups or new_side.read_groups
    try:
        groups = jax.eval_shape(lambda s: fn(rebuild(s)), state)
    except HOST_ONLY:  # reads values on the host: only the run can check it
        return None
    except convert.UnreadableState as e:
        if port.new_groups is not None:  # the port's own new_groups called read_groups
            raise raised(port, field, e, 'new_groups(train_state) -> {group: tree}') from None
        raise fail(
            port,
            'new_state',
            f'returns what the comparison cannot read: {e} (a function of the train state returning {{"params": ..., '
            '"opt_state": ..., "step": {"step": ...}})',
        ) from None
    except Exception as e:  # noqa: BLE001
        raise raised(port, field, e, 'new_groups(train_state) -> {group: tree}') from None
    return _a_dict(port, field, groups)


def legacy_groups(port: LoopPort, state: Any, reader=convert.legacy_groups) -> dict:
    fn = port.legacy_groups or reader
    try:
        groups = jax.eval_shape(fn, state)
    except HOST_ONLY:  # reads values on the host: only the run can check it
        return None
    except Exception as e:  # noqa: BLE001
        if port.legacy_groups is not None:
            raise raised(port, 'legacy_groups', e, 'legacy_groups(train_state) -> {group: tree}') from None
        raise fail(
            port,
            'legacy_state',
            f'returns a {type(state).__name__}, which the comparison cannot read by field or key name '
            '(params, opt_state, step); fix: give the port legacy_groups='
            "lambda state: {'params': ..., 'opt_state': ..., 'step': {'step': ...}}",
        ) from None
    return _a_dict(port, 'legacy_groups' if port.legacy_groups else 'legacy_state', groups)


def _a_dict(port: Port, field: str, groups: Any) -> Any:
    """``groups`` as read, when not None (None is what reading on the host gives, below)."""
    if groups is None:
        raise fail(port, field, "returns None; expected a dict of groups with 'params' (and 'opt_state', 'step')")
    return groups


def _check_params(port: Port, field: str, groups: Any, expected: set[str]) -> None:
    if not isinstance(groups, dict) or groups.get('params') is None:
        given = sorted(groups) if isinstance(groups, dict) else type(groups).__name__
        raise fail(port, field, f"gives {given}; expected a dict of groups with 'params' (and 'opt_state', 'step')")
    flat = jax.tree_util.tree_flatten_with_path(groups['params'])[0]
    paths = {'/'.join(convert.key_name(k) for k in path) for path, _ in flat}
    if paths != expected:
        missing, extra = sorted(expected - paths), sorted(paths - expected)
        reader = field if field.endswith('_groups') else field.replace('_state', '_groups')
        raise fail(
            port,
            field,
            f"'params' holds {len(paths)} leaves, not the model's {len(expected)} parameters "
            f"(missing {missing[:2]}, unexpected {extra[:2]}); fix: give {reader}= whose 'params' is the model's "
            'parameters by module',
        )
