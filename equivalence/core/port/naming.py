"""Which linen variable is which NNX variable: a port's name mapping, checked before any training.

Linen names submodules by class and call order (``Dense_0``, ``LayerNorm_0``); an NNX port
names them by attribute (``fc1``, ``norm``, ``layers/0``). A port says how they correspond:

- ``None``: the paths are the same strings (the built-in workloads);
- a dict of path prefixes, ``{'Dense_0': 'fc1', 'LayerNorm_0': 'norm'}``, matched at ``/``
  boundaries, longest prefix first; paths no prefix matches are kept as they are;
- a function ``linen_path -> nnx_path``;
- ``'structure'``: submodules are paired by what they hold (leaf names, collections,
  shapes, dtypes), and only where that pairing is unique: two submodules holding the same
  shapes are never paired by guesswork, the run stops and names them.

Whatever the form, the result must pair every linen leaf with one NNX leaf of the same
collection, shape and dtype, or ``resolve`` raises ``PortError`` naming the unmatched
paths, their shapes and the closest candidates on the other side.
"""

import collections
import difflib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from equivalence.core.port.config import ConfigError
from equivalence.core.state.paths import key_name, rename_path  # noqa: F401 -- rename_path: part of this API

STRUCTURE = 'structure'
COLLECTIONS = {nnx.Param: 'params', nnx.BatchStat: 'batch_stats'}  # NNX Variable type -> linen collection

Names = None | Mapping[str, str] | Callable[[str], str] | str
Spec = dict[str, tuple[str, tuple[int, ...], str]]  # path -> (collection, shape, dtype)


class PortError(ConfigError):
    """A port whose two sides cannot be paired: exit 2, before any training."""


def _flat(tree: Any) -> list[tuple[str, Any]]:
    """``[('a/b', leaf)]`` in the tree's own order (linen: the order submodules were created)."""
    out = []
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out += [(f'{k}/{p}', leaf) for p, leaf in _flat(v)]
        else:
            out.append((str(k), v))
    return out


def linen_spec(variables: Mapping) -> Spec:
    """Every leaf of a linen variables dict, keyed by its path without the collection."""
    spec = {}
    for collection, tree in variables.items():
        if collection not in COLLECTIONS.values():
            raise PortError(
                f"linen collection {collection!r} is not supported (only 'params' and 'batch_stats' are trained state)"
            )
        for path, leaf in _flat(tree):
            spec[path] = (collection, tuple(np.shape(leaf)), str(leaf.dtype))
    return spec


def nnx_spec(model: nnx.Module) -> Spec:
    """Every parameter and batch statistic of an NNX model (real or abstract), keyed by path."""
    spec = {}
    for var_type, collection in COLLECTIONS.items():
        flat, _ = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, var_type)))
        for path, leaf in flat:
            spec['/'.join(key_name(k) for k in path)] = (collection, tuple(np.shape(leaf)), str(leaf.dtype))
    return spec


def _by_prefix(prefixes: Mapping[str, str]) -> Callable[[str], str]:
    ordered = sorted(prefixes.items(), key=lambda kv: -len(kv[0]))

    def rename(path: str) -> str:
        for old, new in ordered:
            if path == old or path.startswith(old + '/'):
                return new + path[len(old) :]
        return path

    return rename


def _signature(spec: Spec, parent: str) -> tuple:
    leaves = [(p.rsplit('/', 1)[-1], *spec[p]) for p in spec if p.rpartition('/')[0] == parent]
    return tuple(sorted(leaves))


def _by_structure(linen: Spec, nnx_: Spec) -> dict[str, str]:
    """Pair submodules (the parents of leaves) whose contents are unique on both sides."""
    sides = []
    for spec in (linen, nnx_):
        groups = collections.defaultdict(list)
        for parent in dict.fromkeys(p.rpartition('/')[0] for p in spec):
            groups[_signature(spec, parent)].append(parent)
        sides.append(groups)
    pairs, ambiguous = {}, []
    for sig, linen_parents in sides[0].items():
        nnx_parents = sides[1].get(sig, [])
        if len(linen_parents) == len(nnx_parents) == 1:
            pairs[linen_parents[0]] = nnx_parents[0]
        elif linen_parents and nnx_parents:
            ambiguous.append(f'linen {linen_parents} and NNX {nnx_parents} hold the same {_sig_text(sig)}')
    if ambiguous:
        raise PortError(
            'names by structure are ambiguous: '
            + '; '.join(ambiguous)
            + "; pair these with a dict of prefixes, e.g. names={'Dense_1': 'fc2'}"
        )
    return pairs


def _sig_text(sig: tuple) -> str:
    return ', '.join(f'{name} {list(shape)}' for name, _, shape, _ in sig)


def resolve(linen: Spec, nnx_: Spec, names: Names) -> dict[str, str]:
    """``{linen path: nnx path}`` for every leaf, or ``PortError`` naming what does not pair."""
    if names == STRUCTURE:
        parents = _by_structure(linen, nnx_)
        rename = _by_prefix(parents)
    elif names is None:
        rename = lambda p: p  # noqa: E731
    elif isinstance(names, Mapping):
        rename = _by_prefix(names)
    elif callable(names):
        rename = names
    else:
        raise PortError(f"names must be None, a dict of prefixes, a function or 'structure', got {names!r}")
    mapping = {p: str(rename(p)) for p in linen}
    _check(linen, nnx_, mapping)
    return mapping


def _check(linen: Spec, nnx_: Spec, mapping: dict[str, str]) -> None:
    counts = collections.Counter(mapping.values())
    bad_linen = [p for p, q in mapping.items() if q not in nnx_ or nnx_[q] != linen[p] or counts[q] > 1]
    paired = {mapping[p] for p in mapping if p not in bad_linen}
    bad_nnx = [q for q in nnx_ if q not in paired]
    if not bad_linen and not bad_nnx:
        return
    parts = [_unmatched('linen', p, linen[p], nnx_, bad_nnx, mapping[p]) for p in bad_linen]
    parts += [_unmatched('NNX', q, nnx_[q], linen, bad_linen) for q in bad_nnx]
    raise PortError(
        f'linen and NNX variables do not pair ({len(bad_linen)} linen, {len(bad_nnx)} NNX unmatched): '
        + '; '.join(parts)
        + "; give the port names={'linen prefix': 'nnx prefix'}, a function, or names='structure'"
    )


def _unmatched(side: str, path: str, leaf: tuple, other: Spec, candidates: list[str], mapped: str = '') -> str:
    """One unmatched leaf, its shape, and the closest same-shaped candidates on the other side."""
    collection, shape, dtype = leaf
    text = f'{side} {path} {list(shape)} {dtype}'
    if mapped and mapped != path:
        text += f' (mapped to {mapped})'
    same = [c for c in candidates if other[c] == leaf] or candidates
    close = difflib.get_close_matches(path, same, n=2, cutoff=0.0)
    other_side = 'NNX' if side == 'linen' else 'linen'
    if close:
        text += f', closest {other_side}: ' + ', '.join(f'{c} {list(other[c][1])}' for c in close)
    return text
