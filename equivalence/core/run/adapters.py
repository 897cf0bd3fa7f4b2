"""Real training steps as teams wrote them, adapted at the loop port's boundary.

pmap-era code rarely pmaps a scan. It pmaps one step, ``jax.pmap(train_step, axis_name='batch')``
with ``train_step(state, batch[, rng]) -> (state, metrics)``, binds extra arguments with
``functools.partial`` and calls it once per step from a host loop. The loss is one entry of the
metrics, or a function of them (``metrics['loss'] / metrics['denominator']``). A ``LoopPort``
takes such a step as it is (``step_form``, ``loss``, ``legacy_loop``, ``new_step``); this
module turns it into the setups the harness drives, so nothing of it leaks into the harness:

- ``step_form='state'``: ``step(state, batch) -> (state, out)``: no key, or the key inside the state;
- ``step_form='state_rng'``: ``step(state, batch, key) -> (state, out)``: every step gets a fresh
  key from the host chain (per device ``[D, 2]`` or one global key, as ``--rng`` says), as a
  host loop ``rng, step_rng = split(rng)`` hands one to each call;
- ``legacy_loop='steps'`` (the default for these forms) runs ``pmap(step)`` K times per call,
  as the team does; ``'scan'`` fuses them, ``pmap(scan(step))``. The arithmetic is the same;
  the report says which ran.

``out`` is the loss when ``loss`` is None, else a metrics pytree read by ``loss`` (a key or a
function, applied to host arrays of K steps). Every metric is compared too, in its own group
``metrics``. A metric that differs between pmap devices (reduced with no ``pmean``/``psum``) is
not the global value on the pmap side: it is listed as not compared, with that reason.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from equivalence.core.port import step_forms
from equivalence.core.port.config import ConfigError
from equivalence.core.port.plan import Run
from equivalence.core.port.pmaps import pmapped
from equivalence.core.port.ports import LoopPort
from equivalence.core.run import freshness
from equivalence.core.run.facts import once_per_port
from equivalence.core.state import convert
from equivalence.core.state.line import Line
from equivalence.core.state.states import Skip, Uncompared
from legacy_pmap import train as legacy

LOOPS = ('steps', 'scan')


def legacy_loop(port: LoopPort) -> str:
    return port.legacy_loop or step_forms.of(port).default_loop


def check(port: LoopPort) -> None:
    """A loop port's step fields that do not fit together, as ``ConfigError`` (exit 2)."""
    where, form = f'port {port.name!r}', step_forms.of(port)
    if legacy_loop(port) not in LOOPS:
        raise ConfigError(f'{where}: legacy_loop {port.legacy_loop!r} is not one of {", ".join(LOOPS)}')
    form.check_loop(legacy_loop(port), where)
    if (port.new_call is None) == (port.new_step is None):
        raise ConfigError(f'{where}: give exactly one of new_call (K steps per call) and new_step (one step)')
    form.check_new_step(port, where)
    if port.loss is not None and not (isinstance(port.loss, str) or callable(port.loss)):
        raise ConfigError(f'{where}: loss must be a metrics key or a function of the metrics, got {port.loss!r}')


def one_program_each(port: LoopPort, command: str) -> None:
    """explain and bench read one compiled call per side: a step run once per step has none (exit 2)."""
    if legacy_loop(port) == 'steps' or port.new_step is not None:
        cost = '; bench --cost times a check of it as it is' if command == 'bench' else ''
        raise ConfigError(
            f'{command} reads one compiled call per side; port {port.name!r} runs its step once per step: '
            f"give it legacy_loop='scan' and new_call= (K steps in one call) to use it here{cost}"
        )


def programs(port: LoopPort) -> tuple[str, str]:
    """How each side's K steps ran, for the report's header: ``('pmap(step) x K', 'NNX new_call')``, the port's
    own call named as its field; a new side with no NNX model (linen under ``jax.jit``) is not called NNX."""
    legacy_run = 'pmap(step) x K' if legacy_loop(port) == 'steps' else 'pmap(scan)'
    new_run = 'new_step x K' if port.new_step is not None else 'new_call'
    return legacy_run, f'NNX {new_run}' if port.nnx_model is not None else f'{new_run} (linen, jax.jit)'


class Ran(Line):
    """The report's line of how the team's step ran on each side (``describe``), and its values: ``legacy_loop``
    ('steps': pmap(step) called K times a call; 'scan': pmap(scan(step))), ``new_loop`` ('new_step' called K
    times, or 'new_call' of K steps) and ``nnx`` (an NNX model, or linen under jax.jit)."""

    FIELDS = ('legacy_loop', 'new_loop', 'nnx')


class Wrapped(Line):
    """The report's line that the suite ran what a pmapped ``legacy_step`` wraps (``wrapped_notes``), and its values:
    the function run (``step``), whether the pmap wrapped a ``lax.scan`` of it (``scanned``), over ``axis_name``."""

    FIELDS = ('step', 'scanned', 'axis_name')


def describe(port: LoopPort) -> Ran:
    """One line for the report: how the team's step ran on each side."""
    loop, nnx = legacy_loop(port), port.nnx_model is not None
    new_loop = 'new_step' if port.new_step is not None else 'new_call'
    run = 'pmap(step) called K times per call' if loop == 'steps' else 'pmap(scan(step))'
    nnx_run = 'new_step called K times per call' if new_loop == 'new_step' else 'new_call, K steps per call'
    loss = 'the output' if port.loss is None else (repr(port.loss) if isinstance(port.loss, str) else 'loss=function')
    new = 'NNX' if nnx else 'linen under jax.jit'
    text = f'loop port: step{step_forms.of(port).signature} as {run}; {new} {nnx_run}; loss read from {loss}'
    return Ran(text, loop, new_loop, nnx)


# -- reading what a step returns ---------------------------------------------------------------


def read_output(port: LoopPort, out_K: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(losses_K, {metric path: [K, ...]})`` from the host arrays of K steps' outputs."""
    if port.loss is None:
        return np.asarray(out_K, np.float32).reshape(-1), {}
    metrics = convert.flatten(out_K)
    try:
        loss = named_metric(out_K, port.loss) if isinstance(port.loss, str) else port.loss(out_K)
    except Exception as e:  # noqa: BLE001 -- the user's reader failed on the user's metrics: one line, exit 2
        raise ConfigError(f'port {port.name!r}: loss={port.loss!r} on metrics {sorted(metrics)}: {e!r}') from None
    return np.asarray(loss, np.float32).reshape(-1), metrics


def metric_names(out: Any) -> list[str] | None:
    """The names a step's metrics hold: a dict's keys, or the fields of upstream's own metrics class (a
    ``flax.struct`` dataclass, a NamedTuple); None for anything else."""
    if isinstance(out, dict):
        return sorted(out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [f.name for f in dataclasses.fields(out)]
    fields = getattr(type(out), '_fields', None)
    return list(fields) if isinstance(fields, tuple) else None


def named_metric(out: Any, name: str) -> Any:
    """The metric ``name`` (``LoopPort.loss``) of a step's metrics: a dict's key or a metrics class's field."""
    return out[name] if isinstance(out, dict) else getattr(out, name)


def _host_rows(x: jax.Array) -> np.ndarray:
    """A pmap output's rows on this process's devices, on the host."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def replica_outputs(out_nxK: Any) -> tuple[Any, list[str]]:
    """Device 0's outputs ``[K, ...]``, and the metric paths whose value differs between devices."""
    rows_ = jax.tree.map(_host_rows, out_nxK)
    spread = {p: float(np.abs(a - a[:1]).max(initial=0)) for p, a in convert.flatten(rows_).items() if a.size}
    return jax.tree.map(lambda a: a[0], rows_), [p for p, s in spread.items() if s > 0]


# -- keys --------------------------------------------------------------------------------------


def key_draws_per_call(port: LoopPort, config: Run) -> int:
    """How many times one call of a step form draws from the host key chain (``chain_at``)."""
    return step_forms.of(port).key_draws_per_call(config.steps_per_call)


def chain_at(draws_per_call: int, config: Run, rng: jax.Array, calls: int) -> jax.Array:
    """The host key chain after ``calls`` calls of ``draws_per_call`` draws each, drawn as the setups draw
    it: for a checkpoint that holds none (a team's own), so that the resumed run continues the keys of
    the uninterrupted one."""
    for _ in range(calls * draws_per_call):
        rng, _ = legacy.next_call_keys(rng, config.devices, config.rng_mode)
    return rng


# -- the pmap side -----------------------------------------------------------------------------


def _scanned(fn: Any) -> Any | None:
    """``step`` of score_sde's ``functools.partial(jax.lax.scan, step)``, else None."""
    if isinstance(fn, functools.partial) and fn.func is jax.lax.scan and len(fn.args) == 1 and not fn.keywords:
        return fn.args[0]
    return None


def legacy_step(port: LoopPort) -> Callable:
    """The step the suite runs: ``legacy_step`` itself, or, when it is already pmapped (``jax.pmap(step)`` or
    score_sde's ``jax.pmap(partial(lax.scan, step))``), the step it wraps, under the suite's own pmap."""
    inner = pmapped(port.legacy_step)
    if inner is None:
        return port.legacy_step
    return _scanned(inner) or inner


def wrapped_notes(port: LoopPort) -> list[Wrapped]:
    """The report's line saying that the suite ran what a pmapped ``legacy_step`` wraps; [] otherwise."""
    inner = pmapped(port.legacy_step)
    if inner is None:
        return []
    scanned = _scanned(inner)
    step = _name(scanned or inner)
    given = f'functools.partial(jax.lax.scan, {step})' if scanned else step
    text = (
        f'legacy_step is jax.pmap({given}): the suite runs {step} under its own pmap over axis_name={port.axis_name!r}'
    )
    return [Wrapped(text, step, scanned is not None, port.axis_name)]


def _name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f'functools.partial({_name(fn.func)}, ...)'
    return getattr(fn, '__qualname__', None) or type(fn).__name__


_PROGRAMS: dict = {}  # port -> what its pmap side runs: the one step, its fused calls by devices
freshness.kept(_PROGRAMS.clear)


def one_step(port: LoopPort) -> 'TwoOf':
    """``(state, batch, key) -> (state, out)`` from the team's step; what it returns after ``out`` (its logs, say:
    ``(state, metrics, logs)``) is left out, and counted (``TwoOf.extra``). One per port: JAX keys a trace by the
    function, so the pre-flight's trace of it under the run's own pmap is the run's (``preflight.steps``)."""
    held = once_per_port(_PROGRAMS, port, dict)
    if 'one' not in held:
        held['one'] = TwoOf(step_forms.of(port).one_step(legacy_step(port), port))
    return held['one']


def fused_call(port: LoopPort, devices) -> Callable:
    """``legacy.make_fused_call`` of the port's step over ``devices``: one per port and devices (``one_step``)."""
    held, key = once_per_port(_PROGRAMS, port, dict), (tuple(devices), port.axis_name)
    if key not in held:
        held[key] = legacy.make_fused_call(legacy_step(port), devices, port.axis_name)
    return held[key]


class TwoOf:
    """A step whose output is read as ``(state, out)``: a tuple of more is cut to its first two, and ``extra``
    says how many it left out (0 until it was traced), for the report's ``not compared`` line (``unread``)."""

    def __init__(self, step: Callable):
        self.step, self.extra = step, 0

    def __call__(self, *args):
        out = self.step(*args)
        if isinstance(out, tuple) and len(out) > 2 and not hasattr(out, '_fields'):
            self.extra = len(out) - 2
            return out[0], out[1]
        return out


def unread(field: str, extra: int, side: str = '') -> list[Uncompared]:
    """The ``not compared`` line of the outputs a step returned after ``(state, out)``, or none."""
    if not extra:
        return []
    what = f'(state, out, and {extra} more)' if field == 'legacy_step' else f'(train_state, out, and {extra} more)'
    return [Uncompared(f'{field} outputs after the second ({extra})', Skip.EXTRA_OUTPUT,
                       f'it returns {what}: what follows out is not read', side)]  # fmt: skip


def new_rng_keyword(port: LoopPort) -> str | None:
    """The keyword ``new_step`` takes its key by (``step_forms.StateRng.new_rng_keyword``), or None."""
    return step_forms.of(port).new_rng_keyword(port)


def new_step_call(port: LoopPort) -> Callable:
    """``(train_state, batch, key) -> whatever new_step returns``, as the new step is called: no key
    (``'state'``), the key by keyword (``new_rng_keyword``) or third."""
    return step_forms.of(port).new_step_call(port)


def legacy_program(port: LoopPort, devices, one: TwoOf | None = None) -> Callable:
    """``run(pstate, batch_nxK, keys) -> (pstate, out_nxK)``: pmap(step) K times, or pmap(scan(step)); or,
    where the key chain is the scan's carry, as the step expects, the fused call. ``one``: the step it runs
    (``one_step``'s, made here where not given)."""
    carried = lambda: _carried_program(port, devices)  # noqa: E731
    return step_forms.of(port).program(carried, lambda: _stepped_program(port, devices, one or one_step(port)))


def _carried_program(port: LoopPort, devices) -> Callable:
    fused = fused_call(port, devices)
    carry = lambda pstate, batch, keys: _unpack_carry(fused((keys, pstate), batch))  # noqa: E731
    carry.lowered = lambda pstate, batch, keys: [fused.lower((keys, pstate), batch)]  # setups.LegacySetup.lowered
    return carry


def _stepped_program(port: LoopPort, devices, one: TwoOf) -> Callable:
    if legacy_loop(port) == 'scan':
        scan = lambda state, batch_K, keys_K: jax.lax.scan(lambda s, xs: one(s, *xs), state, (batch_K, keys_K))  # noqa: E731
        return jax.pmap(scan, axis_name=port.axis_name, devices=devices, donate_argnums=1)
    p_step = jax.pmap(one, axis_name=port.axis_name, devices=devices)

    def run(pstate, batch_nxK, keys_nxK):
        outs = []
        for k in range(jax.tree.leaves(batch_nxK)[0].shape[1]):
            at_k = lambda v, k=k: v[:, k]  # noqa: E731
            key = None if keys_nxK is None else at_k(keys_nxK)
            pstate, out = p_step(pstate, jax.tree.map(at_k, batch_nxK), key)
            outs.append(jax.tree.map(_host_rows, jax.block_until_ready(out)))  # one step in flight (FACTS)
        return pstate, jax.tree.map(lambda *a: np.stack(a, axis=1), *outs)

    def first(pstate, batch_nxK, keys_nxK) -> tuple:  # its first step's arguments (the K steps share its program)
        at_0 = lambda v: v[:, 0]  # noqa: E731
        return pstate, jax.tree.map(at_0, batch_nxK), None if keys_nxK is None else at_0(keys_nxK)

    lowered = lambda *args: [p_step.lower(*first(*args))]  # noqa: E731
    # its first step traced, ``(jaxpr, (state, out) of one step)``: the pre-flight's, and JAX keeps it for ``lowered``
    traced = lambda *args: jax.make_jaxpr(p_step, return_shape=True)(*first(*args))  # noqa: E731

    def traceable(pstate, batch_nxK, keys_nxK):  # the same steps as one function of arrays (``pruned.call``)
        outs = []
        for k in range(jax.tree.leaves(batch_nxK)[0].shape[1]):
            at_k = lambda v, k=k: v[:, k]  # noqa: E731
            pstate, out = p_step(pstate, jax.tree.map(at_k, batch_nxK), None if keys_nxK is None else at_k(keys_nxK))
            outs.append(out)
        return pstate, jax.tree.map(lambda *a: jnp.stack(a, axis=1), *outs)

    run.lowered, run.traceable, run.traced = lowered, traceable, traced  # setups.LegacySetup's, step_side's forward
    return run


def _unpack_carry(result):
    (_, pstate), out = result
    return pstate, out


def state_and_out(out: Any, train_state: Any) -> tuple[Any, Any, int]:
    """``(the train state after a new step, its output, how many outputs after it were left out)`` of what
    ``new_step`` returned: ``(train_state, out, *more)``, or ``out`` alone (NNX objects updated in place)."""
    if returns_state(out, train_state):
        return out[0], out[1], len(out) - 2
    return train_state, out, 0


def returns_state(out: Any, train_state: Any) -> bool:
    """``(train_state, out, ...)`` rather than ``out`` alone (NNX objects updated in place): the first of two
    or more is the train state itself, holds NNX objects (``nnx.Pytree``: modules, optimizers), or is of its type."""
    if not (isinstance(out, tuple) and len(out) >= 2 and not hasattr(out, '_fields')):
        return False
    first = out[0]
    objects = [x for x in jax.tree.leaves(first, is_leaf=_is_object) if isinstance(x, nnx.Pytree)]
    return first is train_state or bool(objects) or type(first) is type(train_state)


def _is_object(x) -> bool:
    return isinstance(x, nnx.Pytree)
