"""Randomness inside layers other than ``Dropout``: attention dropout bridged, any other draw named.

Flax's attention layers (linen ``MultiHeadDotProductAttention`` and its ``SelfAttention``, NNX
``MultiHeadAttention``) do not go through a ``Dropout`` layer: each draws its mask in its
module's ``dot_product_attention_weights`` as ``random.bernoulli(dropout_rng, keep, shape)``,
the key from ``make_rng('dropout')`` / ``dropout_rng=`` (linen) or its stream / ``rngs=`` (NNX).
While ``randomness.bridged`` is active, both modules' ``dot_product_attention_weights`` are
replaced: the softmax is the layer's own (called with ``deterministic=True``), and the mask is
the bridge's (``masks.mask``) with the same guarantees as ``Dropout``: per example at
level 1 (a mask shared across the batch, ``broadcast_dropout=True``, the layers' default, is
drawn from the shared keys, so every example it covers gets the same bits), from the key the
user's code gave the layer at level 2. The mask is applied with the layer's own formula,
``weights * (keep.astype(dtype) / keep_prob)``. The n-th dropout of a trace, attention or
``Dropout``, folds ``n`` into its key, so both frameworks must call them in the same order.

A layer of the user's own that imports ``dot_product_attention_weights`` by name (Hugging Face's Flax
models: ``from flax.linen.attention import dot_product_attention_weights``, its key from
``self.make_rng('dropout')``) is bridged too: every module's name bound to either framework's function is
replaced while bridged, and a key that the layer drew itself (``make_rng``, an NNX stream) stands for the root
key a ``Dropout`` would use (linen: the key given to ``apply``; NNX: the key ``nnx.reseed`` was given, or the
stream's), so both sides' masks come from the same keys.

Any other draw while bridged is named for the report (``randomness.take_unbridged``): a linen
``make_rng`` of a stream other than ``params`` (at level 1, with no key to give, it stops the
run as a ``PortError`` naming the layer and stream), and an NNX ``RngStream`` drawn from
inside a module's method. Those numbers are the user's: the suite does not make them equal.
"""

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import attention as linen_attention
from flax.linen import module as linen_module
from flax.nnx import rnglib
from flax.nnx.nn import attention as nnx_attention

from equivalence.core.port.naming import PortError
from equivalence.core.rng import masks


def _weights(original: Callable, legacy_side: bool | None) -> Callable:
    """``dot_product_attention_weights`` with the layer's softmax and the bridge's dropout mask."""
    signature = inspect.signature(original)

    def weights(*args, **kwargs):
        bridge = masks._state()
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        rate = given.get('dropout_rate', 0.0)
        if bridge is None or given.get('deterministic', False) or rate == 0.0:
            return original(*args, **kwargs)
        given['deterministic'] = True  # the layer's own weights, without its dropout
        w = original(*bound.args, **bound.kwargs)
        if getattr(masks._active, 'off', False):  # dropout off: the weights as they are, not scaled (as Dropout's)
            return w
        keep = 1.0 - rate
        broadcast = given.get('broadcast_dropout', True)
        shape = [1] * (w.ndim - 2) + list(w.shape[-2:]) if broadcast else list(w.shape)
        key_fn = bridge.attention_key if bridge.attention_key is not None else _root(given['dropout_rng'])
        side = bridge.axis_name is not None if legacy_side is None else legacy_side  # linen: pmap or jax.jit
        keep_mask = masks.mask(shape, keep, key_fn, side, w.shape[0], shared=broadcast)
        return w * (keep_mask.astype(w.dtype) / jnp.asarray(keep, dtype=w.dtype))

    return weights


WEIGHTS = 'dot_product_attention_weights'  # where both frameworks' attention layers draw their dropout

# A key a layer drew itself while bridged (``make_rng``, an NNX stream): id -> (the key, its root key's function,
# the line that names the draw). A key handed to a bridged attention takes its root key and names nothing; the
# rest are named as ``patched`` ends.
_drawn: dict[int, tuple[Any, Callable, str]] = {}


def _root(given: Any) -> Callable:
    """The key function for the key a layer handed ``dot_product_attention_weights``: the root key a ``Dropout``
    would use, where the layer drew ``given`` itself; else ``given``."""
    drawn = _drawn.get(id(given))
    if drawn is None or drawn[0] is not given:
        return lambda: given
    del _drawn[id(given)]
    return drawn[1]


def linen_attention_call(next_fun, args, kwargs, module: nn.Module):
    """A linen attention layer's call with its dropout key given, so that it never calls ``make_rng``
    (at level 1 there is none): the bridge draws the mask from that key or from the example keys."""
    bridge = masks._state()
    deterministic = kwargs.get('deterministic')
    deterministic = module.deterministic if deterministic is None else deterministic
    if module.dropout_rate == 0.0 or deterministic in (None, True) or kwargs.get('dropout_rng') is not None:
        return next_fun(*args, **kwargs)
    if bridge.example_keys is not None:
        key = jax.random.PRNGKey(0)  # not drawn from: level 1 masks come from the per-example keys
    elif module.has_rng('dropout') or module.has_rng('params'):  # linen falls back on 'params' (Scope.make_rng)
        key = module.scope.rngs['dropout' if module.has_rng('dropout') else 'params'].rng  # the root key, as Dropout
    else:
        return next_fun(*args, **kwargs)  # the layer asks for a key itself and says what is missing
    return next_fun(*args, **{**kwargs, 'dropout_rng': key})


def _nnx_attention_call(original: Callable) -> Callable:
    def call(self, *args, rngs=None, **kwargs):
        bridge = masks._state()

        def key():
            if rngs is None and 'dropout' in bridge.reseeded:
                return bridge.reseeded['dropout']
            given = rngs if rngs is not None else self.rngs
            if isinstance(given, rnglib.Rngs):
                given = given['dropout']
            return given.key[...] if isinstance(given, rnglib.RngStream) else given

        previous, bridge.attention_key = bridge.attention_key, key
        try:
            return original(self, *args, rngs=rngs, **kwargs)
        finally:
            bridge.attention_key = previous

    return call


def _make_rng(original: Callable) -> Callable:
    def make_rng(self, name: str = 'params'):
        if masks._state() is not None and name != 'params':
            path = '/'.join(self.scope.path) or type(self).__name__
            if not self.has_rng(name) and not self.has_rng('params'):  # linen falls back on 'params'
                raise PortError(
                    f'the linen layer {path} ({type(self).__name__}) draws from the {name!r} stream with make_rng, '
                    'which the suite does not bridge, and no key was given: draw those numbers in the port '
                    "(ModelPort noise=) and pass them in, or use Dropout or Flax's attention dropout"
                )
            key = original(self, name)
            root = self.scope.rngs[name if self.has_rng(name) else 'params'].rng  # the root key, as linen's Dropout
            _drawn[id(key)] = (key, lambda: root, (
                f'randomness not bridged: linen {path} ({type(self).__name__}) draws from the {name!r} stream '
                '(make_rng): its numbers are not made equal on both sides'))  # fmt: skip
            return key
        return original(self, name)

    return make_rng


def _stream_call(original: Callable) -> Callable:
    def call(self):
        bridge = masks._state()
        key = original(self)
        if bridge is not None and bridge.attention_key is None:
            frame = sys._getframe(1)  # who draws: a module's method (not its __init__, which draws initial values)
            caller = frame.f_locals.get('self') if frame.f_code.co_name != '__init__' else None
            if isinstance(caller, nnx.Module) and not isinstance(caller, nnx.Dropout | nnx.MultiHeadAttention):
                root = bridge.reseeded['dropout'] if 'dropout' in bridge.reseeded else self.key[...]  # as MHA's
                _drawn[id(key)] = (key, lambda: root, (
                    f'randomness not bridged: NNX {type(caller).__name__} draws from the '
                    f'{getattr(self, "tag", "?")!r} stream: its numbers are not made equal on both sides'))  # fmt: skip
        return key

    return call


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """The replacements above, for the duration of a ``randomness.bridged`` block."""
    saved = [
        (linen_attention, WEIGHTS),
        (nnx_attention, WEIGHTS),
        (nnx_attention.MultiHeadAttention, '__call__'),
        (linen_module.Module, 'make_rng'),
        (rnglib.RngStream, '__call__'),
    ]
    originals = [getattr(owner, name) for owner, name in saved]
    replacements = [
        _weights(originals[0], legacy_side=None),
        _weights(originals[1], legacy_side=False),
        _nnx_attention_call(originals[2]),
        _make_rng(originals[3]),
        _stream_call(originals[4]),
    ]
    for module, name, found in _imported(originals[:2]):  # a user's own import of either (HF's models)
        saved.append((module, name))
        originals.append(found)
        replacements.append(replacements[originals.index(found)])
    outer = dict(_drawn)
    _drawn.clear()
    for (owner, name), new in zip(saved, replacements, strict=True):
        setattr(owner, name, new)
    try:
        yield
    finally:
        for (owner, name), old in zip(saved, originals, strict=True):
            setattr(owner, name, old)
        masks._unbridged.update((line, None) for _, _, line in _drawn.values())  # drawn, and handed no attention
        _drawn.clear()
        _drawn.update(outer)


_bound: dict[int, tuple[Any, int, tuple[str, ...]]] = {}  # id(module) -> (it, its names' count, names of WEIGHTS)


def _imported(functions: list) -> list[tuple[Any, str, Callable]]:
    """``(module, name, function)`` for every name that a loaded module (but the functions' own) binds to one of
    ``functions``: ``from flax.linen.attention import dot_product_attention_weights [as w]``. Each module is read
    again only where its names changed in number (at most a few ms a check); a name is taken only where it still
    holds the function, so nothing else a module holds is replaced."""
    owners = {linen_attention.__name__, nnx_attention.__name__}
    found = []
    for module in list(sys.modules.values()):
        names = getattr(module, '__dict__', None)
        if not names or getattr(module, '__name__', None) in owners:
            continue
        seen = _bound.get(id(module))
        if seen is None or seen[0] is not module or seen[1] != len(names):
            held = tuple(n for n, v in list(names.items()) if any(v is f for f in functions))
            _bound[id(module)] = seen = (module, len(names), held)
        found += [(module, n, names[n]) for n in seen[2] if any(names.get(n) is f for f in functions)]
    return found
