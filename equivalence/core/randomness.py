"""Dropout inside the model: both frameworks draw their masks from the same keys, the same way.

Linen and NNX derive a Dropout layer's key differently from the same root key (linen folds
in the module path, NNX counts calls on the layer's stream), and the pmap and sharded
layouts draw per device or once for the global batch. So a model that owns its dropout
gets other masks on each side, and no tolerance could match the two trajectories.

While ``bridged(...)`` is active, every ``nn.Dropout`` and ``nnx.Dropout`` call draws its
mask here instead; the n-th Dropout call of a traced step folds ``n`` into its key:

- the suite's own loops (a model port) hand both sides one key per *example*
  (``example_keys``, drawn from the step key like any other per-example noise, so per
  device or globally as ``--rng`` says); example i's mask row is
  ``bernoulli(fold_in(key_i, n), 1 - rate, row shape)``, the same bits whatever the layout.
- a user's own loops (a loop port) keep their keys: the mask comes from the key their step
  gave the model (linen: ``apply(rngs={'dropout': key})``; NNX: ``nnx.reseed(model,
  dropout=key)``, its twin, or a Dropout's ``rngs=key`` argument; failing both, the layer's
  stream key). NNX's reseed stores ``fold_in(key, i)`` per stream, not ``key``, so while the
  bridge is active ``nnx.reseed`` also records the key it was given. Drawn as each
  path lays out its random numbers (``train.draw_noise`` of each package): per device, or
  one global draw cut into per-device slices on the pmap side.

Deterministic calls, rate 0 and rate 1 behave as the layers do, and so does the scaling:
``select(mask, x / (1 - rate), 0)``, the layers' own formula.

Flax's attention dropout (linen ``MultiHeadDotProductAttention``, NNX ``MultiHeadAttention``)
goes through the same masks (``mask``), counted with the Dropout calls; ``equivalence.core.streams``
does that, and names any layer that draws from a stream the bridge does not cover.

Linen is intercepted through its public ``nn.intercept_methods``; NNX has no interceptor,
so ``nnx.Dropout.__call__`` (and ``nnx.reseed``, see above) are replaced for the duration
of the ``with`` (tracing is single-threaded) and restored after it.
"""

import contextlib
import dataclasses
import threading
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import rnglib
from jax.extend.core import get_opaque_trace_state

from equivalence.core.naming import PortError
from legacy_pmap import train as legacy
from nnx_sharded import train as sharded

DROPOUT_STREAM = 0x0D0  # folded into the step key to make the per-example dropout keys


SHARED_STREAM = 0x5A4  # folded into the step key to make the key of masks shared across the batch


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
    block: the deterministic re-run a MISMATCH's diagnosis compares (``equivalence.core.judge``)."""
    previous = getattr(_active, 'off', False)
    _active.off = True
    try:
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
    if bridge.example_keys is not None:
        return _per_example_mask(shape, keep, bridge, n, batch, shared)
    return _user_key_mask(shape, keep, key_fn(), n, bridge, legacy_side, batch, shared)


def _apply(x: jax.Array, rate: float, broadcast_dims, deterministic: bool, key_fn, legacy_side: bool):
    if rate == 0.0 or deterministic or getattr(_active, 'off', False):
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    shape = [1 if d in broadcast_dims or d - x.ndim in broadcast_dims else s for d, s in enumerate(x.shape)]
    keep = 1.0 - rate
    shared = 0 in broadcast_dims or -x.ndim in broadcast_dims
    keep_mask = mask(shape, keep, key_fn, legacy_side, x.shape[0], shared)
    return jax.lax.select(jnp.broadcast_to(keep_mask, x.shape), x / keep, jnp.zeros_like(x))


def _linen_interceptor(next_fun, args, kwargs, context):
    bridge = _state()
    module = context.module
    if bridge is not None and isinstance(module, nn.MultiHeadDotProductAttention) and context.method_name == '__call__':
        from equivalence.core import streams  # attention dropout: streams builds on this module

        return streams.linen_attention_call(next_fun, args, kwargs, module)
    if bridge is None or not isinstance(module, nn.Dropout) or context.method_name != '__call__':
        return next_fun(*args, **kwargs)
    x, *rest = args
    deterministic = nn.merge_param('deterministic', module.deterministic, kwargs.get('deterministic', *rest[:1]))

    def key():
        if kwargs.get('rng') is not None:
            return kwargs['rng']
        if module.rng_collection not in module.scope.rngs:
            stream = module.rng_collection
            raise PortError(f'the linen {module.name} draws from the {stream!r} stream, but no key was given')
        return module.scope.rngs[module.rng_collection].rng  # the root key given to apply(rngs=...)

    # linen under pmap, or linen under jax.jit as a loop port's new side: the bridge knows which (its axis)
    return _apply(x, module.rate, module.broadcast_dims, deterministic, key, legacy_side=bridge.axis_name is not None)


def _nnx_dropout_call(self, inputs, *, deterministic=None, rngs=None):
    bridge = _state()
    deterministic = deterministic if deterministic is not None else self.deterministic

    def key():
        if rngs is None and self.rng_collection in bridge.reseeded:
            return bridge.reseeded[self.rng_collection]
        given = rngs if rngs is not None else self.rngs
        if isinstance(given, rnglib.Rngs):
            given = given[self.rng_collection]
        return given.key[...] if isinstance(given, rnglib.RngStream) else given

    return _apply(inputs, self.rate, self.broadcast_dims, bool(deterministic), key, legacy_side=False)


def _reseed(original):
    def reseed(node, /, **kwargs):
        bridge = _state()
        bridge.reseeded.update({k: v for k, v in kwargs.items() if k not in ('graph', 'policy')})
        return original(node, **kwargs)

    return reseed


@contextlib.contextmanager
def bridged(rng_mode: str, axis_name: str | None = None, example_keys: Any = None):
    """Dropout masks drawn by the suite while tracing inside this block (see the module docstring);
    ``example_keys``: ``dropout_keys``'s dict (or the per-example keys alone), or None for the user's keys."""
    from equivalence.core import streams  # attention dropout and unbridged draws: streams builds on this module

    previous, original, reseed = _state(), nnx.Dropout.__call__, nnx.reseed
    shared = None
    if isinstance(example_keys, dict):
        example_keys, shared = example_keys['example'], example_keys['shared']
    _active.bridge = _Bridge(rng_mode, axis_name, example_keys, shared)
    nnx.Dropout.__call__, nnx.reseed = _nnx_dropout_call, _reseed(reseed)
    try:
        with nn.intercept_methods(_linen_interceptor), streams.patched():
            yield
    finally:
        nnx.Dropout.__call__, nnx.reseed = original, reseed
        _active.bridge = previous


_unbridged: dict[str, None] = {}  # report lines: draws from streams the bridge does not cover, in order seen


def take_unbridged() -> list[str]:
    """The lines naming every layer that drew randomness the bridge does not cover since the last call."""
    lines = list(_unbridged)
    _unbridged.clear()
    return lines
