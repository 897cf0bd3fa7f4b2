"""What the suite reads of a port's NNX model without allocating it (``ModelFacts``: its variables' names
and shapes, whether it holds batch statistics, dropout, state of its own), the two sides' names paired
(``name_mapping``), and the model built holding linen's weights (``model_holding``).
"""

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx

from equivalence.core.port import naming
from equivalence.core.port.ports import Port, init_inputs
from equivalence.core.run import freshness
from equivalence.core.state import convert

_ABSTRACT: dict[int, tuple[weakref.ref, tuple[Any, Any]]] = {}
freshness.kept(_ABSTRACT.clear)


def once_per_port(cache: dict, port: Port, build: Any) -> Any:
    """``build()``, kept in ``cache`` for as long as ``port`` (this very object) lives."""
    key = id(port)
    held = cache.get(key)
    if held is not None and held[0]() is port:
        return held[1]
    value = build()
    cache[key] = (weakref.ref(port, lambda _, key=key: cache.pop(key, None)), value)
    return value


def abstract_model(port: Port) -> nnx.Module | None:
    """The port's NNX model with shapes and dtypes only: what checks read, nothing allocated. None
    for a loop port without one (its new side is built from linen's variables). Its constructor is traced
    once per port object (``nnx.eval_shape``: 1.8 s for a ViT-S, and a check builds its model five times:
    the run, two twins, the first step recorded), and each model returned is merged anew from that graph,
    with Variables of its own (``copy=True``): what one fills or trains, no other holds."""
    if port.nnx_model is None:
        return None
    graphdef, state = once_per_port(
        _ABSTRACT, port, lambda: nnx.split(nnx.eval_shape(lambda: port.nnx_model(nnx.Rngs(0))))
    )
    return nnx.merge(graphdef, state, copy=True)


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the checks read of a port's abstract NNX model (None where it has none)."""

    spec: Any  # naming.nnx_spec of it
    batch_stats: bool  # it holds nnx.BatchStat
    dropout: bool  # it holds Dropout or attention layers
    own_state: bool  # it holds what linen's variables cannot give: a random stream, an array not in a Variable


_FACTS: dict[int, tuple[weakref.ref, ModelFacts | None]] = {}
_ALONE: ModelFacts | None = None  # while a reference is recorded, every port's (``linen_alone``)
freshness.kept(_FACTS.clear)


def model_facts(port: Port) -> ModelFacts | None:
    """``ModelFacts`` of the port's NNX model, built once per port object (a run asks a dozen times;
    each abstract model is an ``nnx.eval_shape`` of the whole model); None without a model."""
    if _ALONE is not None:
        return _ALONE
    return once_per_port(_FACTS, port, lambda: _read_facts(abstract_model(port)))


def _read_facts(abstract: nnx.Module | None) -> ModelFacts | None:
    if abstract is None:
        return None
    nodes = [node for _, node in nnx.iter_graph(abstract)]
    return ModelFacts(
        naming.nnx_spec(abstract),
        any(isinstance(node, nnx.BatchStat) for node in nodes),
        any(isinstance(node, nnx.Dropout | nnx.MultiHeadAttention) for node in nodes),
        any(isinstance(node, nnx.RngState | jax.core.Tracer | jax.ShapeDtypeStruct) for node in nodes),
    )


@contextlib.contextmanager
def linen_alone(port: Port, batch_KxG: Any) -> Iterator[bool]:
    """While recording a reference (``verdict.referenced``): the port's facts read from its linen model, not its
    NNX one, which the recorder never builds (it may not exist where the pmap code runs, nor import there). The
    one the pmap side reads is whether the model has Dropout or attention layers (then both sides are handed
    dropout keys), as linen's modules say in an abstract ``init``; yields it."""
    import flax.linen as nn

    classes: set[type] = set()

    def seen(next_fun, args, kwargs, context):
        classes.add(type(context.module))
        return next_fun(*args, **kwargs)

    example = jax.tree.map(lambda v: v[0, :1], batch_KxG)
    args, kwargs = init_inputs(port, example)
    key = jax.random.PRNGKey(0)
    with nn.intercept_methods(seen):
        jax.eval_shape(lambda: port.legacy_model().init({'params': key, 'dropout': key}, *args, **kwargs))
    global _ALONE
    dropout = any(issubclass(c, nn.Dropout | nn.MultiHeadDotProductAttention) for c in classes)
    _ALONE = ModelFacts(None, False, dropout, False)  # the port's, and the recording copies made of it
    try:
        yield dropout
    finally:
        _ALONE = None


def name_mapping(port: Port, variables: dict) -> dict[str, str]:
    """``{linen path: NNX path}`` for every variable, from an abstract NNX model (nothing is
    allocated); ``naming.PortError`` (exit 2) when the two sides do not pair. Without an NNX
    model the new side keeps linen's names: ``{}``."""
    facts = model_facts(port)
    if facts is None:
        return {}
    return naming.resolve(naming.linen_spec(variables), facts.spec, port.names)


def has_batch_stats(port: Port) -> bool:
    facts = model_facts(port)
    return facts is not None and facts.batch_stats


def uses_dropout(port: Port) -> bool:
    """Whether the NNX model has Dropout or attention layers (then the suite hands both sides dropout keys)."""
    facts = model_facts(port)
    return facts is not None and facts.dropout


def model_holding(port: Port, variables: dict, mapping: dict | None = None) -> nnx.Module:
    """The port's NNX model holding linen's variables. Built abstractly first (``nnx.eval_shape``: no
    initializer runs, so none is compiled) and filled with linen's arrays. What linen does not give (a
    Dropout's random stream: its key and counter) is computed by the port's own constructor, traced once
    under ``jax.jit``, of which XLA keeps only those values: one small program instead of every
    initializer compiled and run one by one (score_sde's UNet: 9 programs, 5 s; bitwise the same values,
    being integers and keys). A model that holds another value of its own (an array of floats not in
    linen's variables), or that cannot be built abstractly, is built for real, as before."""
    mapping = name_mapping(port, variables) if mapping is None else mapping
    try:
        model = abstract_model(port)
        convert.load_linen_variables(model, variables, mapping)
        if _own_values(port, model):
            return model
    except Exception:  # noqa: BLE001 -- built for real below, where the port's own error is raised
        pass
    model = port.nnx_model(nnx.Rngs(0))
    convert.load_linen_variables(model, variables, mapping)
    return model


def _own_values(port: Port, model: nnx.Module) -> bool:
    """Fill ``model``'s values that linen's variables did not (integers and keys only), from the port's
    constructor under ``jax.jit``; False (nothing filled) when another kind of value is left."""
    left = {path for path, value in nnx.iter_graph(model) if _abstract(value)}
    flat = [(path, v) for path, v in nnx.to_flat_state(nnx.state(model)) if path in left]
    if len(flat) != len(left) or not all(_exact(v.get_value().dtype) for _, v in flat):
        return not left  # an abstract value that is no Variable, or of floats: built for real
    values = _constructed(port.nnx_model, frozenset(path for path, _ in flat))
    for path, v in flat:
        v.set_value(_on_device(values[path]))
    return True


@functools.lru_cache(maxsize=16)
def _constructed(nnx_model, wanted: frozenset) -> dict:
    """The values at ``wanted`` of the port's constructor under ``jax.jit``, on the host (``_on_host``): computed
    once per constructor, so that every model built after the first (the twin's, the verdict's recordings') is
    given them without a program. A recording's model compiled its own, its random draws recorded: a ViT at 2e5
    parameters, 1.8 s of a 10 s hold (issue 59)."""

    def own() -> dict:
        built = nnx.to_flat_state(nnx.state(nnx_model(nnx.Rngs(0))))
        return {path: v.get_value() for path, v in built if path in wanted}

    return {path: _on_host(value) for path, value in jax.jit(own)().items()}


freshness.kept(_constructed.cache_clear)


def _on_host(value: jax.Array) -> tuple:
    """``(numpy data, key implementation or None)``: an integer, boolean or key array, bitwise."""
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(value)), jax.random.key_impl(value)
    return np.asarray(value), None


def _on_device(held: tuple) -> jax.Array:
    """A fresh array of ``_on_host``'s value (each model its own: a step may donate its state's buffers)."""
    data, impl = held
    return jax.numpy.asarray(data) if impl is None else jax.random.wrap_key_data(data, impl=impl)


def _exact(dtype) -> bool:
    """A dtype whose values a compiled constructor gives bitwise as an eager one: integers, booleans, keys."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return jax.numpy.issubdtype(dtype, jax.numpy.integer) or jax.numpy.issubdtype(dtype, jax.numpy.bool_)


def _abstract(value) -> bool:
    if isinstance(value, nnx.Variable):
        value = value.get_value()
    return isinstance(value, jax.ShapeDtypeStruct | jax.core.Tracer)
