"""A loop port's own NNX call, rebuilt in the suite's shipped form as far as it can be derived.

A loop port hands the suite one opaque call, ``nnx_call(train_state, keys, batch_KxG)``. What
the suite can change without touching the team's step is how that call is *wrapped*:

- ``jit_state``: the same call traced once under ``jax.jit`` over its split state (the
  ``nnx.State`` of ``nnx.split``): no object-graph walk on every call;
- ``jit_dict``: as shipped by ``nnx_sharded/train.py``: the state as a plain dict
  (``nnx.to_pure_dict``), donated, its output placement pinned to its input's.

What it cannot derive is inside the step: where the loss is averaged (per step, or after the
scan), how the gradient is formed (all-reduce before or after the kernel transposes), the
optimizer. Those are read from the compiled program instead (``advice``) and named, not timed.
"""

import dataclasses
from collections.abc import Callable

import jax
from flax import nnx

from equivalence.bench.variants import Feed, Variant, _config, _nnx_chain, _nnx_place
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import LoopPort
from equivalence.core.rng import randomness
from equivalence.core.run import setups

FORMS = {  # name -> (label, state as a plain dict and donated)
    'nnx_jit_state': ("the port's call under jax.jit, split state", False),
    'nnx_jit_dict': ('... as a plain dict, donated (shipped form)', True),
}
NOT_DERIVED = (
    'inside your step, not derivable from a loop port (read from its compiled program, not timed): '
    'where the loss is averaged, where the gradient is all-reduced, the optimizer'
)


@dataclasses.dataclass
class Derived:
    variants: list[Variant]
    notes: list[str]  # what could not be rebuilt, and why


def _pure_call(setup: setups.LoopNewSetup, plain_dict: bool) -> tuple[Callable, object]:
    """``(jax.jit(call over the split state), placed state)``: the port's call, traced once."""
    graphdef, state = nnx.split(setup.train_state)
    port, rng_mode = setup.port, setup.config.rng_mode

    def pure(state, keys, batch_KxG):
        with randomness.bridged(rng_mode):
            ts, losses_K = port.new_call(nnx.merge(graphdef, state), keys, batch_KxG)
        new = nnx.state(ts)
        return (nnx.to_pure_dict(new) if plain_dict else new), losses_K

    if not plain_dict:
        return jax.jit(pure), state
    state = nnx.to_pure_dict(state)
    shardings = jax.tree.map(lambda a: a.sharding, state)
    return jax.jit(pure, donate_argnums=0, out_shardings=(shardings, None)), state


def form_variant(port: LoopPort, config: Run, feed: Feed, k: int, name: str) -> Variant:
    """One derived form of the port's call at K, with its own state, inputs and key chain."""
    label, plain_dict = FORMS[name]
    holder = {}

    def build(kk: int):
        setup = feed.kind.new_setup(_config(config, kk), feed.inputs)
        fn, state = _pure_call(setup, plain_dict)
        return setup, fn, state

    setup, fn, holder['state'] = build(k)
    place = _nnx_place(setup, _nnx_chain(feed, setup, k))

    def call(args: tuple) -> jax.Array:
        with randomness.bridged(config.rng_mode):  # entered on every call, as for the port's own call
            holder['state'], losses_K = fn(holder['state'], *args)
        return losses_K

    def fresh_lowered(kk: int):
        fresh, fresh_fn, state = build(kk)
        return fresh_fn.lower(state, *_nnx_place(fresh, _nnx_chain(feed, fresh, kk))(1)[0])

    return Variant(name, label, k, place, call, fresh_lowered)


def derive(port: LoopPort, config: Run, feed: Feed) -> Derived:
    """Both forms at the configured K; a form whose call cannot be traced over split state is
    left out, with the reason (the port's call may hold host-side work that ``jax.jit`` refuses)."""
    out = Derived([], [NOT_DERIVED])
    for name in FORMS:
        try:
            v = form_variant(port, config, feed, config.steps_per_call, name)
            v.fresh_lowered(config.steps_per_call)  # traces the port's call: fails here, not while timed
        except Exception as e:  # noqa: BLE001 -- the port's code: reported, the bench goes on
            out.notes.append(f'{FORMS[name][0]}: cannot be derived ({type(e).__name__}: {str(e)[:160]})')
            continue
        out.variants.append(v)
    return out
