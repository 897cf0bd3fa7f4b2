"""Both sides' fused calls, built as the harness builds them and traced with ``jax.eval_shape``."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from equivalence.core.port.config import ConfigError
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import LoopPort, ModelPort, Port
from equivalence.core.preflight import device_keys
from equivalence.core.preflight.errors import HOST_ONLY, NNX_PARAMS, blamed, fail, kind
from equivalence.core.rng import randomness
from equivalence.core.run import abstract, adapters, facts, loop_side, setups
from equivalence.core.state import new_side
from equivalence.distributed import rows
from legacy_pmap import train as legacy
from nnx_sharded import train as sharded

SDS = jax.ShapeDtypeStruct


def legacy_state(port: LoopPort, variables: dict) -> Any:
    """One replica of a loop port's legacy train state, shapes only."""
    with blamed(port, 'legacy_state', 'legacy_state(linen_variables) -> your train state'):
        state = jax.eval_shape(port.legacy_state, variables)
    if not jax.tree.leaves(state):
        raise fail(port, 'legacy_state', f'returned {kind(state)} holding no arrays; expected your train state')
    return state


def model_legacy_state(port: ModelPort, variables: dict) -> Any:
    """One replica of the suite's legacy train state for a model port, shapes only."""
    tx = make_tx(port)
    with blamed(port, 'make_tx', 'make_tx(lr_scale) -> optax.GradientTransformation'):
        return jax.eval_shape(lambda v: legacy.create_state(v, tx, port.ema_rate), variables)


def make_tx(port: Port) -> Any:
    with blamed(port, 'make_tx', 'make_tx(lr_scale) -> optax.GradientTransformation'):
        tx = port.make_tx(1.0)
    if not (callable(getattr(tx, 'init', None)) and callable(getattr(tx, 'update', None))):
        raise fail(port, 'make_tx', f'returned a {type(tx).__name__}: return an optax.GradientTransformation')
    return tx


def trace_legacy_loop(port: LoopPort, config: Run, variables: dict, batch_KxG: Any) -> Any:
    """A loop port's step under the suite's pmap(scan) (``loop_side.legacy_setup``), traced once: where
    ``batch_KxG`` is one call's data, the run's own program from arguments of the run's shapes and placement
    (``run.abstract``), a trace the run then finds."""
    state = legacy_state(port, variables)
    if not abstract.concrete(batch_KxG):
        trace_legacy(port, config, state, adapters.legacy_step(port), port.axis_name, 'legacy_step', batch_KxG)
        batch = jax.tree.map(lambda v: SDS((v.shape[1] // config.devices, *v.shape[2:]), v.dtype), batch_KxG)
        device_keys.refuse_global(port, config, state, batch, SDS((2,), np.uint32), config.devices)
        return state
    setup = loop_side.legacy_setup(port, config, {}, pstate=abstract.replicas(state, config, port.axis_name))
    args = setup.call_args(jax.random.PRNGKey(config.seed), batch_KxG)[1]
    with blamed(port, 'legacy_step'):
        closed, (_, loss_DxK) = setup.traced(args)
    n, k = len(rows.positions(config.devices)), config.steps_per_call
    check_losses(port, 'legacy_step', loss_DxK, (n, k), 'one mean loss per step (a scalar, pmean-ed)')
    device_keys.refuse_in_program(port, config, closed.jaxpr)
    return state


def trace_legacy_model(port: ModelPort, config: Run, variables: dict, batch_KxG: Any) -> Any:
    """The suite's pmap(scan) step over a model port's loss (``model_side.legacy_setup``), traced once."""
    state = model_legacy_state(port, variables)
    tx, b = make_tx(port), config.batch_size // config.devices
    loss = checked_loss(port, 'legacy_loss', setups.legacy_loss(port, config), b, with_state=True)
    noise = setups.port_noise(port, facts.uses_dropout(port))
    step = legacy.make_step_fn(port.legacy_model(), loss, noise, tx, port.ema_rate, config.rng_mode)
    return trace_legacy(port, config, state, step, legacy.AXIS, 'legacy_loss', batch_KxG)


def trace_legacy(port: Port, config: Run, state: Any, step, axis: str, field: str, batch_KxG: Any) -> Any:
    """``step`` under pmap(scan), traced once on abstract keys, ``state`` (one replica) and batch."""
    d, k = config.devices, config.steps_per_call
    n = len(rows.positions(d))  # pmap takes this process's rows: all D in one process
    stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype), state)
    keys = jax.ShapeDtypeStruct((n, 2), np.uint32)
    batch = jax.tree.map(lambda v: jax.ShapeDtypeStruct((n, k, v.shape[1] // d, *v.shape[2:]), v.dtype), batch_KxG)
    fused = legacy.make_fused_call(step, jax.devices()[:d], axis)
    with blamed(port, field), randomness.bridged(config.rng_mode, axis):
        (_, loss_DxK) = jax.eval_shape(fused, (keys, stacked), batch)
    check_losses(port, field, loss_DxK, (n, k), 'one mean loss per step (a scalar, pmean-ed)')
    return state


def checked_loss(port: Port, field: str, loss_fn: Any, b: int, with_state: bool) -> Any:
    """``loss_fn`` as the suite's loop calls it, its result checked while traced: ``[b]`` losses
    (and the model state, unchanged in structure, on the legacy side)."""

    def loss(model, *args):
        out = loss_fn(model, *args)
        losses = out
        if with_state:
            if not isinstance(out, tuple) or len(out) != 2:
                raise fail(
                    port, field, f'returned a tuple of {len(out)}: return losses_B, or (losses_B, new model_state)'
                )
            losses, new_state = out
            if jax.tree.structure(new_state) != jax.tree.structure(args[1]):
                raise fail(port, field, 'returned a model_state of another structure than the one it was given')
        if isinstance(losses, dict) and set(losses) == {'loss', 'weight'}:  # token sums and weights per example
            for part in ('loss', 'weight'):
                _check_per_example(port, field, losses[part], b, f"['{part}']")
            return out
        _check_per_example(port, field, losses, b, '')
        return out

    return loss


def _check_per_example(port: Port, field: str, losses: Any, b: int, part: str) -> None:
    shape = getattr(losses, 'shape', None)
    if shape != (b,):
        given = f'shape {list(shape)}' if shape is not None else f'a {type(losses).__name__}'
        raise fail(
            port,
            field,
            f'returned{part} {given}; expected one loss per example, shape [{b}] (the suite averages them), '
            "or {'loss': sums_B, 'weight': weights_B}",
        )


def abstract_keys(config: Run) -> jax.ShapeDtypeStruct:
    """One call's keys, shapes only: ``[D, 2]`` per device, or one global key."""
    return jax.ShapeDtypeStruct((config.devices, 2) if config.rng_mode == 'per-device' else (2,), np.uint32)


def trace_nnx_model(port: ModelPort, config: Run, batch_KxG: Any) -> Any:
    """The NNX call of ``model_side.new_setup`` in split form, traced once; the abstract train state."""
    mode, keys = config.rng_mode, abstract_keys(config)
    tx = make_tx(port)
    with blamed(port, 'nnx_model', 'nnx_model(rngs) -> nnx.Module'):
        model = nnx.eval_shape(lambda: port.nnx_model(nnx.Rngs(0)))
    with blamed(port, 'make_tx', fix=NNX_PARAMS):  # its optimizer initialised on the NNX parameters
        ts = nnx.eval_shape(lambda m: sharded.TrainState(m, tx, port.ema_rate), model)
    graphdef, state = nnx.split(ts)
    loss = checked_loss(port, 'nnx_loss', setups.nnx_loss(port, config), config.batch_size, with_state=False)
    step = sharded.make_step_fn(graphdef, loss, setups.port_noise(port, facts.uses_dropout(port)), port.ema_rate, mode)
    with blamed(port, 'nnx_loss'):
        _, loss_K = jax.eval_shape(sharded.scan_steps(step), (keys, nnx.to_pure_dict(state)), batch_KxG)
    check_losses(port, 'nnx_loss', loss_K, (config.steps_per_call,), 'one mean loss per step')
    return ts


NEW_STATE = 'new_state(nnx_model or, without one, linen_variables) -> your new train state'


def nnx_train_state(port: LoopPort, variables: dict) -> Any:
    """The port's new train state, shapes only, built as the run builds it (``loop_side.new_source``):
    from the abstract NNX model (``facts.abstract_model``, the constructor traced once, as the names were
    paired), or from linen's abstract variables. Where it cannot be traced (upstream state code that needs
    concrete arrays: a reshard helper rebuilding its leaves from their shards), it is built for real, from
    zeros of linen's shapes or a fresh NNX model: a mistake it makes then is the port's one line, as any other."""
    try:
        if port.nnx_model is None:
            ts = jax.eval_shape(port.new_state, variables)
        else:
            ts = nnx.eval_shape(lambda model: port.new_state(model), facts.abstract_model(port))
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 -- traced it raised: built for real below, where a mistake is the port's
        ts = _built_for_real(port, variables)
    with blamed(port, 'new_state', NEW_STATE):
        arrays = jax.tree.leaves(nnx.state(ts) if new_side.form(ts) == new_side.OBJECTS else ts)
    if not arrays:
        raise fail(port, 'new_state', f'returned {kind(ts)} holding no arrays; expected your new train state')
    return ts


def _built_for_real(port: LoopPort, variables: dict) -> Any:
    """``new_state`` run for real: on zeros of linen's abstract variables, or on the port's NNX model."""
    with blamed(port, 'new_state', NEW_STATE):
        if port.nnx_model is None:
            return port.new_state(jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), variables))
        return port.new_state(port.nnx_model(nnx.Rngs(0)))


def as_traced(ts: Any) -> tuple[Any, Any]:
    """``(what a trace takes, rebuild)``: NNX objects split into their state (merged back inside the
    trace); a pytree train state as it is, so that every leaf reaches the user's code with its real
    type (a ``TrainState``'s plain-array ``step`` stays an array: ``jax.eval_shape`` over the pytree)."""
    if new_side.form(ts) == new_side.PYTREE:
        return ts, lambda state: state
    graphdef, state = nnx.split(ts)
    return state, lambda state: nnx.merge(graphdef, state)


def trace_nnx_loop(port: LoopPort, config: Run, batch_KxG: Any, variables: dict) -> Any:
    """A loop port's ``new_call`` over its abstract new train state, traced once; that train state. Where
    ``batch_KxG`` is one call's data, from arguments of the run's own shapes and placement: the run's call then
    finds this trace (``run.abstract``)."""
    keys = abstract_keys(config)
    ts = nnx_train_state(port, variables)
    state, rebuild = as_traced(ts)
    run = abstract.concrete(batch_KxG)
    if run:  # as the run's first call: its state placed, its keys and batch as its setup places them
        mesh = setups.nnx_mesh(config)
        state = abstract.placed(state, mesh)
        setup = setups.LoopNewSetup(port, None, mesh, config)
        keys, batch_KxG = setup.call_args(jax.random.PRNGKey(config.seed), batch_KxG)[1]

    def pure(state, keys, batch):
        new_ts, losses_K = pair(port, 'new_call', port.new_call(rebuild(state), keys, batch), '(train_state, losses_K)')
        return same_nnx_state(port, 'new_call', new_ts, state), losses_K

    with blamed(port, 'new_call'), randomness.bridged(config.rng_mode):
        try:
            _, losses_K = jax.eval_shape(pure, state, keys, batch_KxG)
        except HOST_ONLY:  # host-side code in the call: it runs eagerly, and only the run can check it
            return ts
    if run:
        abstract.traced_with(port, ts)
    check_losses(port, 'new_call', losses_K, (config.steps_per_call,), 'one mean loss per step, shape [K]')
    return ts


def pair(port: Port, field: str, out: Any, expected: str) -> tuple[Any, Any]:
    """``out`` as the two things a step returns, or ``PreflightError`` naming what it returned."""
    if not isinstance(out, tuple) or len(out) != 2:
        given = f'a tuple of {len(out)}' if isinstance(out, tuple) else kind(out)
        raise fail(port, field, f'returned {given}; expected {expected}')
    return out


def same_nnx_state(port: Port, field: str, new_ts: Any, state: Any) -> Any:
    """What ``as_traced`` makes of the train state ``field`` returned, which must have the structure of
    ``state`` (the one it was given): its NNX state, or the pytree itself."""
    if new_side.form(state) == new_side.PYTREE and new_side.form(new_ts) == new_side.PYTREE:
        new_state = new_ts
    else:
        try:
            new_state = nnx.state(new_ts)
        except Exception:  # noqa: BLE001 -- not NNX objects at all
            raise fail(
                port,
                field,
                f'returned a train state of type {type(new_ts).__name__}; expected the '
                'train state it was given (its NNX objects)',
            ) from None
    if jax.tree.structure(new_state) != jax.tree.structure(state):
        raise fail(port, field, 'returned a train state of another structure than the one it was given')
    return new_state


def check_losses(port: Port, field: str, losses: Any, expected: tuple[int, ...], what: str) -> None:
    shape = getattr(losses, 'shape', None)
    if shape == expected:
        return
    given = f'losses of shape {list(shape)}' if shape is not None else f'{type(losses).__name__} as its losses'
    raise fail(port, field, f'returned {given}; expected {list(expected)}: {what}')
