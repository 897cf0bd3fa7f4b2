"""What the comparison reads: both train states grouped, with the parameters where expected."""

from typing import Any

import jax

from equivalence.core import convert, naming, new_side
from equivalence.core.ports import LoopPort, Port
from equivalence.core.preflight.data import check_names
from equivalence.core.preflight.errors import HOST_ONLY, PreflightError, fail, line
from equivalence.core.preflight.trace import as_traced


def check_groups(port: LoopPort, legacy_state: Any, nnx_ts: Any, variables: dict) -> None:
    """Both train states grouped as the comparison reads them, with the parameters where expected."""
    groups = legacy_groups(port, legacy_state)
    expect = {p for p, (c, _, _) in naming.linen_spec(variables).items() if c == 'params'}
    if groups is not None:
        _check_params(port, 'legacy_groups' if port.legacy_groups else 'legacy_state', groups, expect)
    check_new_groups(port, nnx_ts, variables)


def check_new_groups(port: LoopPort, ts: Any, variables: dict) -> None:
    """The new train state (abstract), in whatever form (``new_side``), grouped as the comparison reads
    it, with the model's parameters under the paths the names pair them with."""
    mapping = check_names(port, variables)
    expect = {p for p, (c, _, _) in naming.linen_spec(variables).items() if c == 'params'}
    state, rebuild = as_traced(ts)
    fn = port.new_groups or new_side.read_groups
    field = 'new_groups' if port.new_groups else 'new_state'
    try:
        groups = jax.eval_shape(lambda s: fn(rebuild(s)), state)
    except HOST_ONLY:  # reads values on the host: only the run can check it
        return
    except TypeError as e:
        if port.new_groups is not None or 'new_groups=' not in str(e):
            raise PreflightError(line(port, field, e, 'new_groups(train_state) -> {group: tree}')) from None
        raise fail(
            port,
            'new_state',
            f'returns what the comparison cannot read: {e} (a function of the train state returning {{"params": ..., '
            '"opt_state": ..., "step": {"step": ...}})',
        ) from None
    except Exception as e:  # noqa: BLE001
        raise PreflightError(line(port, field, e, 'new_groups(train_state) -> {group: tree}')) from None
    _check_params(port, field, groups, {mapping.get(p, p) for p in expect})


def legacy_groups(port: LoopPort, state: Any) -> dict:
    fn = port.legacy_groups or convert.legacy_groups
    try:
        return jax.eval_shape(fn, state)
    except HOST_ONLY:  # reads values on the host: only the run can check it
        return None
    except Exception as e:  # noqa: BLE001
        if port.legacy_groups is not None:
            raise PreflightError(
                line(port, 'legacy_groups', e, 'legacy_groups(train_state) -> {group: tree}')
            ) from None
        raise fail(
            port,
            'legacy_state',
            f'returns a {type(state).__name__}, which the comparison cannot read by '
            'field name (.params, .opt_state, .step); fix: give the port legacy_groups='
            "lambda state: {'params': ..., 'opt_state': ..., 'step': {'step': ...}}",
        ) from None


def _check_params(port: Port, field: str, groups: Any, expected: set[str]) -> None:
    if not isinstance(groups, dict) or groups.get('params') is None:
        given = sorted(groups) if isinstance(groups, dict) else type(groups).__name__
        raise fail(port, field, f"gives {given}; expected a dict of groups with 'params' (and 'opt_state', 'step')")
    flat = jax.tree_util.tree_flatten_with_path(groups['params'])[0]
    paths = {'/'.join(convert.key_name(k) for k in path) for path, _ in flat}
    if paths != expected:
        missing, extra = sorted(expected - paths), sorted(paths - expected)
        raise fail(
            port,
            field,
            f"'params' holds {len(paths)} leaves, not the model's {len(expected)} parameters "
            f'(missing {missing[:2]}, unexpected {extra[:2]})',
        )
