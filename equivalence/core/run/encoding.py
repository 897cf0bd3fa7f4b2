"""A recording's structure as a JSON value beside its arrays (``reference``'s file): ``encode``, and its inverse
``decode``. A named tuple or dataclass is kept by its class name and fields, and by where its class is defined
(``module:qualname``): a check reads a batch of upstream's own class (``Batch(rays=Rays(...), rgb=...)``, a
``flax.struct.dataclass``) back as that class, found in its module among those the check has imported (the
port's own), never importing one."""

import dataclasses
import sys
from typing import Any

import jax
import ml_dtypes
import numpy as np


class Unreadable(Exception):
    """A record whose class this process cannot find (``decode``): the words of what it holds and the fix."""


class Unheld(TypeError):
    """A value a reference cannot hold (``encode``): ``held``, its type (a pytree of its own flatten functions)."""

    def __init__(self, held: type):
        super().__init__(f'a reference cannot hold {held.__name__}')
        self.held = held


def encode(tree: Any, arrays: list) -> Any:
    """``tree`` as a JSON value, each array appended to ``arrays`` and named by its index. Keeps what the
    verdict reads apart: a tuple from a list, a set, a dict of any keys (a device index), a typed key (its key
    data and implementation), a named tuple or dataclass by its class and fields. ``Unheld`` on anything
    else (a pytree registered by its own flatten functions)."""
    if tree is None or isinstance(tree, bool | str) or type(tree) in (int, float):
        return tree
    if isinstance(tree, jax.Array) and jax.dtypes.issubdtype(tree.dtype, jax.dtypes.prng_key):
        arrays.append(np.asarray(jax.random.key_data(tree)))
        return {'key': len(arrays) - 1, 'impl': str(jax.random.key_impl(tree))}
    if isinstance(tree, np.ndarray | np.generic | jax.Array | int | float):
        a = np.asarray(tree)
        if a.dtype.kind == 'V' and a.dtype.names is None:  # bfloat16 and the other ml_dtypes: .npy keeps no name
            arrays.append(a.view(f'u{a.dtype.itemsize}'))  # their bits, as unsigned integers of their width
            return {'array': len(arrays) - 1, 'dtype': a.dtype.name}
        arrays.append(a)
        return {'array': len(arrays) - 1}
    if isinstance(tree, tuple) and hasattr(tree, '_fields'):
        return _record(tree, tree._asdict(), arrays)
    if dataclasses.is_dataclass(tree):
        return _record(tree, {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}, arrays)
    if isinstance(tree, tuple):
        return {'tuple': [encode(v, arrays) for v in tree]}
    if isinstance(tree, list):
        return [encode(v, arrays) for v in tree]
    if isinstance(tree, set | frozenset):
        return {type(tree).__name__: [encode(v, arrays) for v in sorted(tree, key=repr)]}
    if hasattr(tree, 'items'):  # a dict, a FrozenDict, an nnx.State read as pure
        return {'dict': [[encode(k, arrays), encode(v, arrays)] for k, v in tree.items()]}
    raise Unheld(type(tree))


def _record(tree: Any, fields: dict, arrays: list) -> dict:
    cls = type(tree)
    return {'record': cls.__name__, 'class': f'{cls.__module__}:{cls.__qualname__}',
            'fields': {k: encode(v, arrays) for k, v in fields.items()}}  # fmt: skip


def decode(node: Any, arrays: dict, types: dict[str, type]) -> Any:
    """``encode``'s inverse; ``types``: the named tuples and dataclasses it may hold by class name, where a
    record names no class (a reference recorded before records did) or names one not imported here."""
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if isinstance(node, list):
        return [decode(v, arrays, types) for v in node]
    if 'array' in node:
        a = arrays[node['array']]
        return a.view(getattr(ml_dtypes, node['dtype'])) if 'dtype' in node else a
    if 'key' in node:
        return jax.random.wrap_key_data(arrays[node['key']], impl=node['impl'])
    if 'record' in node:
        cls = imported(node.get('class')) or types.get(node['record'])
        if cls is None:
            raise Unreadable(unfound(node['record'], node.get('class')))
        return cls(**{k: decode(v, arrays, types) for k, v in node['fields'].items()})
    if 'tuple' in node:
        return tuple(decode(v, arrays, types) for v in node['tuple'])
    if 'set' in node or 'frozenset' in node:
        kind, items = next(iter(node.items()))
        return (set if kind == 'set' else frozenset)(_hashable(decode(v, arrays, types)) for v in items)
    return {_hashable(decode(k, arrays, types)): decode(v, arrays, types) for k, v in node['dict']}


def imported(name: Any) -> type | None:
    """The named tuple or dataclass that ``module:qualname`` names, where its module is imported; else None."""
    if not isinstance(name, str) or ':' not in name:
        return None
    module, _, qualname = name.partition(':')
    found: Any = sys.modules.get(module)
    for part in qualname.split('.'):
        found = getattr(found, part, None) if found is not None else None
    named_tuple = isinstance(found, type) and issubclass(found, tuple) and hasattr(found, '_fields')
    return found if named_tuple or (isinstance(found, type) and dataclasses.is_dataclass(found)) else None


def unfound(record: str, name: str | None) -> str:
    """What a record is whose class cannot be found here, and the fix."""
    if name is None:
        return f'holds a {record}, which this suite does not read'
    module, _, qualname = name.partition(':')
    if '<locals>' in qualname:
        return f'holds a {record} defined inside a function ({qualname}): define it at the top level of {module}'
    return (f'holds a {record} ({module}.{qualname}), which this process has not imported: import {module} in the '
            "port's module")  # fmt: skip


def _hashable(x: Any) -> Any:
    """A 0-d array where a set or a key held a number (``encode`` keeps numbers as arrays): the number."""
    if isinstance(x, np.ndarray) and x.ndim == 0:
        return x.item()
    if isinstance(x, tuple):
        return tuple(_hashable(v) for v in x)
    return x
