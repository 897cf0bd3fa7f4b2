"""A pmap step whose random numbers depend on the device it runs on: google-research's
``rng = fold_in(rng, lax.axis_index('batch'))``, the key kept in the train state or handed in. Under global keys
(``--rng global``) the suite gives the new side one key for the global batch and draws the pmap side's Dropout
masks as slices of one global draw; a step that folds in its device index draws each device's own numbers
instead, which that cannot give, and a correct port MISMATCHes, blamed on randomness (issue 60). So the
pre-flight reads it from the step's jaxpr, traced with the pmap axis bound (``jax.make_jaxpr(axis_env=...)``,
where ``axis_index`` stays itself: under ``vmap`` it becomes an iota): a random operation fed by a value that
the device index reaches is refused in global mode, one line, before anything trains."""

from typing import Any

import jax
from jax.extend import core as jax_core

from equivalence.core.port.plan import Run
from equivalence.core.port.ports import LoopPort
from equivalence.core.preflight.errors import fail
from equivalence.core.run import adapters

# JAX's random operations that read a key or its bits: a device index reaching one makes the numbers per device
RANDOM = frozenset({'random_fold_in', 'random_bits', 'random_split', 'threefry2x32', 'random_seed'})


# Under ``vmap`` the device index is an ``iota``: a step whose vmapped jaxpr has no iota reaching a random
# operation has no device index reaching one either, and need not be traced again with the axis bound
UNDER_VMAP = frozenset({'axis_index', 'iota'})


def refuse_global(
    port: LoopPort, config: Run, state: Any, batch: Any, key: Any, devices: int, vmapped: Any = None
) -> None:
    """``PreflightError`` where ``config`` asks for global keys and the port's pmap step (one replica's
    ``state``, ``batch`` and ``key``, shapes only) draws from a key that its device index reaches. ``vmapped``:
    the step's jaxpr as the pre-flight traced it under ``vmap``, where every ``iota`` is read as a device index
    (more than there are): where none reaches a random operation, the step is not traced a second time (a
    ViT-3E6's pre-flight: 2.2 of its 7.2 s)."""
    if config.rng_mode != 'global':
        return
    if vmapped is not None and not by_device(vmapped, [False] * len(vmapped.invars), UNDER_VMAP)[0]:
        return
    try:
        closed = jax.make_jaxpr(adapters.one_step(port), axis_env=[(port.axis_name, devices)])(state, batch, key)
    except Exception:  # noqa: BLE001 -- what the step raises, the pre-flight's own trace says in its words
        return
    if not by_device(closed.jaxpr, [False] * len(closed.jaxpr.invars))[0]:
        return
    raise _per_device(port)


def _per_device(port: LoopPort) -> Exception:
    return fail(
        port,
        'legacy_step',
        f'draws its random numbers from a key its device index reaches (lax.axis_index({port.axis_name!r}), '
        'folded in): each pmap device draws its own, which global keys (--rng global) cannot give the new side; '
        "check it with per-device keys (--rng per-device, and rng_modes=('per-device',) where the port declares "
        'its modes): the new side then gets the key of each device (docs/port.md#the-device-count)',
    )


def refuse_in_program(port: LoopPort, config: Run, jaxpr: Any) -> None:
    """``refuse_global`` of the step's jaxpr traced under the run's own pmap, where ``axis_index`` is the device
    index itself: read once, with no second trace."""
    if config.rng_mode == 'global' and by_device(jaxpr, [False] * len(jaxpr.invars))[0]:
        raise _per_device(port)


def by_device(
    jaxpr: Any, tainted: list[bool], sources: frozenset = frozenset({'axis_index'})
) -> tuple[bool, list[bool]]:
    """``(whether a random operation reads a value the device index reaches, which outputs it reaches)`` of
    ``jaxpr``, its inputs reached as ``tainted`` says, the device index being what the equations named in
    ``sources`` give. Into a jaxpr inside an equation (a jit, scan, cond, remat, custom derivative) by position
    where its inputs line up with the equation's; else all or none of them."""
    reached = {v for v, t in zip(jaxpr.invars, tainted, strict=True) if t}
    hit = False
    for eqn in jaxpr.eqns:
        ins = [not isinstance(v, jax_core.Literal) and v in reached for v in eqn.invars]
        inner_hit, outs = _inner(eqn, ins, sources)
        hit = hit or inner_hit or (eqn.primitive.name in RANDOM and any(ins))
        reached |= {v for v, t in zip(eqn.outvars, outs, strict=True) if t}
    return hit, [not isinstance(v, jax_core.Literal) and v in reached for v in jaxpr.outvars]


def _inner(eqn: Any, ins: list[bool], sources: frozenset) -> tuple[bool, list[bool]]:
    """``by_device`` of an equation: its own outputs reached where an input is (or where it is one of
    ``sources``), and through every jaxpr it holds."""
    outs = [any(ins) or eqn.primitive.name in sources] * len(eqn.outvars)
    hit = False
    for inner in _jaxprs(eqn.params):
        n = len(inner.invars)
        lined_up = ins if n == len(ins) else ins[len(ins) - n :] if 0 < n < len(ins) else [any(ins)] * n
        inner_hit, inner_outs = by_device(inner, lined_up, sources)
        hit = hit or inner_hit
        if len(inner_outs) == len(outs):
            outs = [a or b for a, b in zip(outs, inner_outs, strict=True)]
        elif any(inner_outs):
            outs = [True] * len(outs)
    return hit, outs


def _jaxprs(params: dict) -> list[Any]:
    """The jaxprs an equation's parameters hold (a ``ClosedJaxpr`` is read as its jaxpr)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jax_core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jax_core.Jaxpr):
                found.append(item)
    return found
