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
goes through the same masks (``mask``), counted with the Dropout calls; ``equivalence.core.rng.streams``
does that, and names any layer that draws from a stream the bridge does not cover.

Linen is intercepted through its public ``nn.intercept_methods``; NNX has no interceptor,
so ``nnx.Dropout.__call__`` (and ``nnx.reseed``, see above) are replaced for the duration
of the ``with`` (tracing is single-threaded) and restored after it.

The bridge acts while JAX traces, so a trace is only right where it was made: with the bridge,
with dropout off (``dropout_off``), or without either (the user's own calls). Both set a JAX user
context (``masks.TRACES``, ``jax.make_user_context``), which JAX keys its traces and compiled
programs on: a user's own jitted step keeps one trace per setting, none is reused where another
holds, and nothing clears JAX's caches (which would make a notebook or a pytest worker trace
everything again).
"""

import contextlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import rnglib

from equivalence.core.port.naming import PortError
from equivalence.core.rng import masks, streams
from equivalence.core.rng.masks import _active, _state, dropout_keys, dropout_off, mask, take_unbridged  # noqa: F401 -- part of this API


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
        return streams.linen_attention_call(next_fun, args, kwargs, module)
    if bridge is None or not isinstance(module, nn.Dropout) or context.method_name != '__call__':
        return next_fun(*args, **kwargs)
    x, *rest = args
    deterministic = nn.merge_param('deterministic', module.deterministic, kwargs.get('deterministic', *rest[:1]))

    def key():
        if kwargs.get('rng') is not None:
            return kwargs['rng']
        stream = module.rng_collection
        if stream not in module.scope.rngs and 'params' in module.scope.rngs:
            stream = 'params'  # linen's own fallback (Scope.make_rng): a model handed one key, as ToNNX(rngs=key)
        if stream not in module.scope.rngs:
            raise PortError(f'the linen {module.name} draws from the {stream!r} stream, but no key was given')
        return module.scope.rngs[stream].rng  # the root key given to apply(rngs=...)

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
    previous, original, reseed = _state(), nnx.Dropout.__call__, nnx.reseed
    shared = None
    if isinstance(example_keys, dict):
        example_keys, shared = example_keys['example'], example_keys['shared']
    _active.bridge = masks._Bridge(rng_mode, axis_name, example_keys, shared)
    nnx.Dropout.__call__, nnx.reseed = _nnx_dropout_call, _reseed(reseed)
    try:
        keyed = masks.TRACES(('bridged', rng_mode, axis_name, example_keys is not None, masks.TRACES.value))
        with nn.intercept_methods(_linen_interceptor), streams.patched(), keyed:
            yield
    finally:
        nnx.Dropout.__call__, nnx.reseed = original, reseed
        _active.bridge = previous
