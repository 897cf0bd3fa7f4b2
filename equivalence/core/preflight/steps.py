"""A loop port whose step is written as teams write it (``equivalence.core.run.adapters``): one step
of each side traced with ``jax.eval_shape`` before anything trains.

The pmap side's step is traced under ``jax.vmap`` with the port's ``axis_name`` bound, one row per
device of this process, exactly the arguments the adapter will hand it (state, one step's batch
rows, the step's key). The new side is traced as the adapter calls it (``adapters.new_step_call``:
the key by keyword where the step takes it so): ``new_step`` once on one step's global batch, or
``new_call`` on K steps, over the train state as it is (``trace.as_traced``). What each returns
is then read as the run will read it: ``(state, out)``, the state unchanged in structure, and
``loss`` (None, a key or a function) giving one loss per step. A step that runs host code
(``np.asarray`` of a result) cannot be traced: it is left to the run, whose errors are blamed on
the port's frame (exit 2).
"""

from typing import Any

import jax
import numpy as np

from equivalence.core.port import step_forms
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import LoopPort
from equivalence.core.preflight import device_keys
from equivalence.core.preflight.errors import HOST_ONLY, blamed, fail, kind
from equivalence.core.preflight.groups import check_new_groups
from equivalence.core.preflight.trace import as_traced, legacy_state, nnx_train_state, pair, same_nnx_state
from equivalence.core.rng import randomness
from equivalence.core.run import abstract, adapters, setups, step_side
from equivalence.distributed import rows

SDS = jax.ShapeDtypeStruct


def trace_steps(port: LoopPort, config: Run, variables: dict, batch_KxG: Any, mapping: dict) -> tuple:
    """Both sides' steps, traced on abstract inputs of the run's shapes; ``PreflightError`` (exit 2)
    naming the field on the first mistake. Returns both abstract train states ``(legacy, new)``, built once."""
    state = trace_legacy_step(port, config, variables, batch_KxG)
    return state, trace_new_steps(port, config, batch_KxG, variables, mapping)


def trace_new_steps(port: LoopPort, config: Run, batch_KxG: Any, variables: dict, mapping: dict) -> Any:
    """The new side's half of ``trace_steps`` (a check against a reference runs it alone); its abstract train state."""
    ts = nnx_train_state(port, variables)
    trace_nnx_side(port, config, batch_KxG, ts)
    check_new_groups(port, ts, variables, mapping)
    return ts


def trace_legacy_step(port: LoopPort, config: Run, variables: dict, batch_KxG: Any) -> Any:
    """One step of the legacy side traced; its abstract train state (one replica). Where the run calls
    ``pmap(step)`` once a step and ``batch_KxG`` is one call's data (not shapes), the very program the run lowers,
    from arguments of the run's own shapes and placement (``run_step``): the run then traces nothing again. Else
    under a vmap standing for its pmap."""
    d, n = config.devices, len(rows.positions(config.devices))
    state = legacy_state(port, variables)
    if adapters.legacy_loop(port) == 'steps' and abstract.concrete(batch_KxG):
        return run_step(port, config, state, batch_KxG)
    stacked = jax.tree.map(lambda s: SDS((n, *s.shape), s.dtype), state)
    batch = jax.tree.map(lambda v: SDS((n, v.shape[1] // d, *v.shape[2:]), v.dtype), batch_KxG)
    keys = SDS((n, 2), np.uint32)
    expected = f'legacy_step{step_forms.of(port).expected}'
    one = adapters.one_step(port)

    def step(state, batch, key):
        out = one(state, batch, key)
        new_state, out = pair(port, 'legacy_step', out, expected)
        if jax.tree.structure(new_state) != jax.tree.structure(state):
            raise fail(port, 'legacy_step', 'returned a state of another structure than the one it was given')
        return out

    with blamed(port, 'legacy_step', expected), randomness.bridged(config.rng_mode, port.axis_name):
        try:
            closed, out_n = jax.make_jaxpr(jax.vmap(step, axis_name=port.axis_name), return_shape=True)(
                stacked, batch, keys
            )
        except HOST_ONLY:
            return state
    k = config.steps_per_call
    check_loss(port, 'legacy_step', jax.tree.map(lambda s: SDS((k, *s.shape[1:]), s.dtype), out_n), k)
    one_row = lambda tree: jax.tree.map(lambda s: SDS(s.shape[1:], s.dtype), tree)  # noqa: E731
    device_keys.refuse_global(port, config, state, one_row(batch), SDS((2,), np.uint32), d, closed.jaxpr)
    return state


def run_step(port: LoopPort, config: Run, state: Any, batch_KxG: Any) -> Any:
    """``trace_legacy_step`` of the program the run lowers (``step_side.legacy_setup``'s, its first step), traced
    from the arguments its ``call_args`` makes of one call's data and a replicated abstract ``state``: the same
    checks of what it returns, and of a device index reaching its random draws (read in the pmap's own jaxpr,
    where ``axis_index`` is the device index)."""
    expected = f'legacy_step{step_forms.of(port).expected}'
    stacked = abstract.replicas(state, config, port.axis_name)
    setup = step_side.legacy_setup(port, config, {}, pstate=stacked)
    _, args = setup.call_args(jax.random.PRNGKey(config.seed), batch_KxG)
    with blamed(port, 'legacy_step', expected):
        try:
            closed, out = setup.traced(args)
        except HOST_ONLY:
            return state
    new_state, out_n = pair(port, 'legacy_step', out, expected)
    if jax.tree.structure(new_state) != jax.tree.structure(stacked):
        raise fail(port, 'legacy_step', 'returned a state of another structure than the one it was given')
    k = config.steps_per_call
    check_loss(port, 'legacy_step', jax.tree.map(lambda s: SDS((k, *s.shape[1:]), s.dtype), out_n), k)
    device_keys.refuse_in_program(port, config, closed.jaxpr)
    return state


def trace_nnx_side(port: LoopPort, config: Run, batch_KxG: Any, ts: Any) -> None:
    """One step (or fused call) of the new side over ``ts``, the abstract train state ``nnx_train_state`` built.
    Where ``batch_KxG`` is one call's data, from arguments of the run's own shapes and placement (``run_args``):
    the run's call then finds this trace (``run.abstract``)."""
    state, rebuild = as_traced(ts)  # a pytree train state as it is: its leaves keep their real types
    d, k, mode = config.devices, config.steps_per_call, config.rng_mode
    key = SDS((d, 2) if mode == 'per-device' else (2,), np.uint32)
    field = 'new_step' if port.new_step is not None else 'new_call'
    step = adapters.new_step_call(port) if port.new_step is not None else None
    run = abstract.concrete(batch_KxG)

    def pure(state, keys, batch):
        ts = rebuild(state)
        if step is not None:
            new_ts, out, _ = adapters.state_and_out(step(ts, batch, keys), ts)
        else:
            new_ts, out = pair(port, field, port.new_call(ts, keys, batch), '(train_state, out_K)')
        same_nnx_state(port, field, new_ts, state)
        return out

    if run:  # as the run's first call: its state placed, its keys and batch made by the setup's call_args
        state, (keys, batch) = abstract.placed(state, setups.nnx_mesh(config)), run_args(port, config, batch_KxG)
    elif step is not None:  # one step, its global batch
        batch, keys = jax.tree.map(lambda v: SDS(v.shape[1:], v.dtype), batch_KxG), key
    else:  # the fused call: its keys as its form takes them (one per step, stacked; one; none)
        batch, keys = batch_KxG, step_forms.of(port).fused_keys(key, k)
    with blamed(port, field, _new_step_form(port)), randomness.bridged(mode):
        try:
            out = jax.eval_shape(pure, state, keys, batch)
        except HOST_ONLY:
            return
    if run:
        abstract.traced_with(port, ts)
    if step is not None:
        out = jax.tree.map(lambda s: SDS((k, *s.shape), s.dtype), out)
    check_loss(port, field, out, k)


def run_args(port: LoopPort, config: Run, batch_KxG: Any) -> tuple:
    """``(keys, batch)`` of the new side's first call as its setup makes them from one call's data
    (``step_side.StepNewSetup.call_args``, on the run's mesh): its first step's where it runs one a step."""
    setup = step_side.StepNewSetup(port, None, setups.nnx_mesh(config), config)
    keys, batch = setup.call_args(jax.random.PRNGKey(config.seed), batch_KxG)[1]
    return (keys[0], batch[0]) if port.new_step is not None else (keys, batch)


def _new_step_form(port: LoopPort) -> str:
    """How the new step is called, for its one line: ``new_step(train_state, batch, dropout_rng=key)``."""
    if port.new_step is None:
        return ''
    keyword = adapters.new_rng_keyword(port)
    key, hint = step_forms.of(port).new_step_text(keyword)
    return f'new_step(train_state, batch{key}) -> (train_state, out){hint}'


def check_loss(port: LoopPort, field: str, out_K: Any, k: int) -> None:
    """The step's output ``[K, ...]`` read by ``port.loss`` as the run reads it: one loss per step."""
    if port.loss is None:
        if adapters.metric_names(out_K) is not None:  # metrics (a dict, a metrics class): its loss is one
            names = adapters.metric_names(out_K)
            raise fail(port, field, f'returns metrics {names}, and the port gives no loss=: name the one that is '
                                    "the loss (loss='loss'), or give a function of them")  # fmt: skip
        losses = out_K
    elif isinstance(port.loss, str):
        names = adapters.metric_names(out_K)
        if names is None or port.loss not in names:
            given = f'metrics {names}' if names is not None else kind(out_K)
            raise fail(port, 'loss', f'{port.loss!r} is not in what {field} returns ({given}): name one of them, '
                                     'or give a function of them (loss=lambda metrics: ...)')  # fmt: skip
        losses = adapters.named_metric(out_K, port.loss)
    else:
        with blamed(port, 'loss', 'loss(metrics_K) -> losses_K'):
            try:
                losses = jax.eval_shape(port.loss, out_K)
            except HOST_ONLY:
                return
    size = int(np.prod(getattr(losses, 'shape', (-1,))))
    if size != k:
        what = 'the loss it returns' if port.loss is None else f'loss={port.loss!r}'
        raise fail(port, field, f'gives {kind(losses)} for {k} steps through {what}; expected one loss per step')
