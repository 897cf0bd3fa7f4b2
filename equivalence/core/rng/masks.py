"""The dropout bridge's state and its masks: what ``randomness`` (Dropout) and ``streams``
(attention dropout, unbridged draws) both draw from while ``randomness.bridged`` is active.
See ``randomness`` for the rule the masks follow.
"""

import contextlib
import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import get_opaque_trace_state

from equivalence.core.port.naming import PortError
from equivalence.core.rng import draws
from legacy_pmap import train as legacy
from nnx_sharded import train as sharded

DROPOUT_STREAM = 0x0D0  # folded into the step key to make the per-example dropout keys


SHARED_STREAM = 0x5A4  # folded into the step key to make the key of masks shared across the batch

TRACES = jax.make_user_context(None)  # part of every trace's key: what the bridge was doing (randomness)


@dataclasses.dataclass
class _Bridge:
    rng_mode: str  # 'per-device' or 'global'
    axis_name: str | None  # the pmap axis, on the legacy side
    example_keys: Any = None  # [examples, 2]: one key per example of this side's batch; None: the user's keys
    shared_keys: Any = None  # [examples, 2]: the same key on every example a shared mask covers
    reseeded: dict = dataclasses.field(default_factory=dict)  # NNX stream name -> the key nnx.reseed was given
    counts: list = dataclasses.field(default_factory=list)  # [trace state, calls so far] per trace seen
    attention_key: Any = None  # NNX: the key function of the MultiHeadAttention being called, while it runs


_active = threading.local()


def _state() -> _Bridge | None:
    return getattr(_active, 'bridge', None)


def example_keys(step_key: jax.Array, spec) -> jax.Array:
    """One key per example of the batch ``spec`` describes: drawn like any per-example noise."""
    n = jax.tree.leaves(spec)[0].shape[0]
    return jax.random.split(jax.random.fold_in(step_key, DROPOUT_STREAM), n)


def dropout_keys(step_key: jax.Array, spec) -> dict:
    """What a model port's step hands the bridge: a key per example, and a key per example that is the
    same on every example (for masks shared across the batch: one per device, or one in all)."""
    n = jax.tree.leaves(spec)[0].shape[0]
    shared = jnp.broadcast_to(jax.random.fold_in(step_key, SHARED_STREAM), (n, *step_key.shape))
    return {'example': example_keys(step_key, spec), 'shared': shared}


def _call_index(bridge: _Bridge) -> int:
    """n for the n-th Dropout call under the current trace (from 0 again when JAX traces a body again)."""
    trace = get_opaque_trace_state(convention='flax')
    for entry in bridge.counts:
        if entry[0] == trace:
            entry[1] += 1
            return entry[1] - 1
    bridge.counts.append([trace, 1])
    return 0


def _per_example_mask(shape: list[int], keep: float, bridge: _Bridge, n: int, batch: int, shared: bool) -> jax.Array:
    """Example i's mask from its own key; a mask shared across the batch from the shared keys, so
    every example it covers draws the same bits."""
    keys_B = bridge.example_keys
    if batch != keys_B.shape[0]:
        raise PortError(
            f'a dropout input of shape {shape} does not lead with the batch axis ({keys_B.shape[0]} examples here); '
            'the suite draws dropout masks per example'
        )
    if shared:
        if bridge.shared_keys is None:
            raise PortError('a dropout that shares its mask over the batch axis needs the shared keys (dropout_keys)')
        keys_B = bridge.shared_keys
    return jax.vmap(lambda k: jax.random.bernoulli(jax.random.fold_in(k, n), keep, tuple(shape[1:])))(keys_B)


def _user_key_mask(shape: list, keep: float, key, n: int, bridge: _Bridge, legacy_side: bool, batch: int, shared: bool):
    """The mask from the key the user's code gave the layer, per device or for the global batch."""
    draw = lambda k, b: {'x': jax.random.bernoulli(jax.random.fold_in(k, n), keep, b['x'].shape)}  # noqa: E731
    spec = {'x': jax.ShapeDtypeStruct(tuple(shape), jnp.float32)}
    if shared:  # shared across the batch: this device's key (pmap), or one per device row (NNX)
        if legacy_side or _mode_of(key) == 'global':
            return draw(key, spec)['x']
        per_row = jax.vmap(lambda k: draw(k, spec)['x'])(key).reshape(-1, *shape[1:])
        return jnp.repeat(per_row, batch // per_row.shape[0], axis=0)
    if legacy_side:
        return legacy.draw_noise(draw, key, spec, bridge.rng_mode, bridge.axis_name)['x']
    return sharded.draw_noise(draw, key, spec, _mode_of(key))['x']


def _mode_of(key: jax.Array) -> str:
    """A key the user's NNX code passed: one per device (``[D]`` typed, ``[D, 2]`` raw) or one in all."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    return 'per-device' if key.ndim == (1 if typed else 2) else 'global'


@contextlib.contextmanager
def dropout_off():
    """Every bridged dropout (layers and attention) passes its input through while tracing in this
    block: the deterministic re-run a MISMATCH's diagnosis compares (``equivalence.core.judge.judge``)."""
    previous = getattr(_active, 'off', False)
    _active.off = True
    try:
        with TRACES(('dropout off', TRACES.value)):  # traced again, not taken from a bridged trace
            yield
    finally:
        _active.off = previous


def mask(shape: list[int], keep: float, key_fn, legacy_side: bool, batch: int, shared: bool) -> jax.Array:
    """The bridge's mask of ``shape`` (1 on broadcast axes) for the n-th dropout of this trace;
    ``batch``: the input's leading size; ``shared``: the layer broadcasts its mask over the batch axis."""
    if getattr(_active, 'off', False):
        return jnp.ones(shape, bool)
    bridge = _state()
    n = _call_index(bridge)
    with draws.bridge():  # drawn otherwise on each side by design: compared as the Dropout's output instead
        if bridge.example_keys is not None:
            return _per_example_mask(shape, keep, bridge, n, batch, shared)
        return _user_key_mask(shape, keep, key_fn(), n, bridge, legacy_side, batch, shared)


_unbridged: dict[str, None] = {}  # report lines: draws from streams the bridge does not cover, in order seen


def take_unbridged() -> list[str]:
    """The lines naming every layer that drew randomness the bridge does not cover since the last call."""
    lines = list(_unbridged)
    _unbridged.clear()
    return lines
