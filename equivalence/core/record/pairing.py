"""The recorded first-step calls of the two sides paired, and their values set side by side.

``intercept`` records every module call of the first step on each side and on the twin; this pairs
a linen call with the NNX call that computes the same thing, through the port's ``names``: a linen
module with the NNX module that holds what it holds (``check_names``' leaf mapping, read upwards);
one without variables by the same renaming of its path; a Dropout by its place among the Dropout
calls, which is how the randomness bridge keys its masks. ``trees`` lays the paired values out as
three neutral trees (legacy, NNX, twin) that the verdict's rule compares leaf by leaf (``locate``);
``recorded_grads`` reads a model port's first gradient as its optimizer was given it.
"""

import contextlib
import os

import numpy as np

from equivalence.core.record import intercept
from equivalence.core.record.intercept import GRADS, NOT_MODULES, Record


def _renamed(path: str, names) -> str:
    """A module path without variables, renamed as the port renames variable paths."""
    if isinstance(names, dict):
        for old in sorted(names, key=len, reverse=True):
            if path == old or path.startswith(old + '/'):
                return names[old] + path[len(old) :]
    elif callable(names):
        with contextlib.suppress(Exception):
            return str(names(path))
    return path


def _module_target(path: str, mapping: dict[str, str], names) -> str | None:
    """The NNX module that holds what linen module ``path`` holds; None when no one module holds exactly that.

    Each of its leaves' NNX paths cut at ``path``'s depth names a candidate; where they differ (an NNX port keeps
    its layers in a list, ``mlp/layers/0``, one level deeper than linen's ``MLP_0/Dense_0``, beside
    ``mlp/density``), the module is their common ancestor, provided it holds no leaf that ``path`` does not
    (google/mipnerf's MLP and model, tried blind, were never paired, so the model's output was never compared).
    One candidate is held to the same rule: Hugging Face's Flax ViT against an NNX port that keeps a layer's
    attention flat (``attn/query`` beside ``attn/out``), tried blind, paired HF's self-attention (its query, key and
    value) with ``attn``, which holds its output projection too, and a correct port parted there."""
    if not path:  # the model: the NNX model holds what it holds, however much deeper linen nests its layers
        return ''
    depth = len(path.split('/'))
    found, news = set(), set()
    for leaf, new in mapping.items():
        if not leaf.startswith(path + '/'):
            continue
        below, parts = leaf.count('/') + 1 - depth, new.split('/')
        found.add('/'.join(parts[: len(parts) - below]) if len(parts) >= below else None)
        news.add(new)
    if not found:
        return _renamed(path, names)
    if None in found:
        return None
    common = '/'.join(os.path.commonprefix([candidate.split('/') for candidate in found]))
    if not common:  # a submodule is not the model
        return None
    held = {new for new in mapping.values() if new.startswith(common + '/')}
    return common if held == news else None


def pairs(legacy: dict[str, Record], nnx_: dict[str, Record], mapping: dict[str, str], names) -> dict[str, str]:
    """``{linen label: NNX label}`` of the module calls both sides made (``path`` or ``path#n`` for
    the (n+1)-th call); Dropouts no renaming pairs, by their order among the Dropout calls."""
    out = {}
    for label in legacy:
        if label in NOT_MODULES:
            continue
        path, _, n = label.partition('#')
        target = _module_target(path, mapping, names)
        other = target if not n else f'{target}#{n}'
        if target is not None and other in nnx_:
            out[label] = other
    # One NNX call is one record in ``trees``: where two linen calls reach it (a call without variables renamed onto
    # another's module), the deepest keeps it. Modules holding variables cannot meet here: each pairs only with the
    # module that holds exactly its variables, at its own depth.
    deepest = {}
    for label, other in out.items():
        if other not in deepest or label.count('/') > deepest[other].count('/'):
            deepest[other] = label
    out = {label: other for label, other in out.items() if deepest[other] == label}
    by_order = lambda side: sorted((lab for lab, r in side.items() if 'Dropout' in r.cls), key=lambda x: side[x].order)  # noqa: E731
    taken = set(out.values())
    for a, b in zip(by_order(legacy), by_order(nnx_), strict=False):
        if a not in out and b not in taken:
            out[a] = b
    return out


def trees(raw: dict, paired: dict[str, str]) -> tuple[dict, dict, dict]:
    """The legacy, NNX and twin values of every paired call, keyed ``<nnx label>/in|out/<i>``: inputs and
    outputs as far as both sides passed arrays. An output one side alone gives is no difference: a linen
    block that returns ``(x, x)`` against its NNX port's ``x`` (google-research/vdm's ``ResnetBlock``, tried
    blind) parted with '-' figures and failed a correct port; what a caller reads of it, it reads as an input."""
    out = ({}, {}, {})
    for old, new in paired.items():
        a, b, t = raw['legacy'][old], raw['new'][new], raw.get('twin', {}).get(new)
        for which, tag in ((0, 'in'), (1, 'out'))[: 1 if old and other_inputs(a, b) else 2]:
            n_a, n_b = len(a.values[0][which]), len(b.values[0][which])
            n_t = len(t.values[0][which]) if t is not None else 0
            for i in range(min(n_a, n_b)):
                key, like = f'{new}/{tag}/{i}', b.values[0][which][i]
                twin = t.values[0][which][i] if i < n_t else None
                out[0][key], out[1][key], twin = one_row(intercept.value(a, i, which, like), like, twin)
                if twin is not None:
                    out[2][key] = twin
    return out


def other_inputs(a: Record, b: Record) -> bool:
    """Whether two paired calls (not the model's own) take their arrays in another number: their outputs are then
    no one function's, and are not compared. Hugging Face's Flax ViT, tried blind, adds a layer's residual inside
    its ``ViTOutput``, which takes it as a second array, where an NNX port adds it in the block: a correct port
    parted there by the residual's size."""
    return len(a.values[0][0]) != len(b.values[0][0])


def residual_moved(trees: tuple[dict, dict, dict], label: str, allowed: float | None) -> bool:
    """Whether every output of paired call ``label`` that parts does so by exactly one of the call's inputs (within
    ``allowed``, either sign): one side adds a residual inside the module and the other after it, the same function
    cut otherwise (``x + f(x)`` against ``f(x)``). A slip that leaves the residual out parts the next call's input
    instead, where it is placed."""
    legacy, new = trees[0], trees[1]
    ins = [np.asarray(legacy[k], np.float64) for k in legacy if k.startswith(f'{label}/in/')]
    outs = [k for k in legacy if k.startswith(f'{label}/out/') and k in new]
    if allowed is None or not ins or not outs:
        return False
    parted = [np.asarray(legacy[k], np.float64) - np.asarray(new[k], np.float64) for k in outs]
    parted = [d for d in parted if np.abs(d).max(initial=0.0) > allowed]
    fits = lambda d: any(x.shape == d.shape and np.abs(x).max(initial=0.0) > allowed  # noqa: E731
                         and min(np.abs(d - x).max(), np.abs(d + x).max()) <= allowed for x in ins)  # fmt: skip
    return bool(parted) and all(fits(d) for d in parted)


def one_row(legacy: np.ndarray, new: np.ndarray, twin: np.ndarray | None) -> tuple:
    """``(legacy, new, twin)``, where one side passes a value the same for every example (``[B, ...]``, every row
    equal) and the other that one row (``[1, ...]``, or ``[...]``) broadcast: each as that row, so that it compares
    (the position ids and embeddings of a Transformer, ``broadcast_to(arange(T), [B, T])`` against
    ``arange(T)[None]``: Hugging Face's Flax GPT-2 against an NNX port, tried blind, was not located past them).
    A value whose rows differ is left as it is: its shapes do not compare, and nothing is placed after it."""
    legacy, new = np.asarray(legacy), np.asarray(new)
    if legacy.shape == new.shape:
        return legacy, new, twin
    row = _row_of(new.shape, legacy)
    if row is not None:
        return row, new, twin
    row = _row_of(legacy.shape, new)
    if row is None:
        return legacy, new, twin
    if twin is not None and np.shape(twin) == new.shape:  # the twin's own first row: the floor of that row
        twin = np.asarray(twin)[:1].reshape(legacy.shape)
    return legacy, row, twin


def _row_of(shape: tuple, full: np.ndarray) -> np.ndarray | None:
    """``full``'s first row, shaped ``shape``, where ``full`` is ``[B, ...]`` with every row equal and ``shape`` is
    one such row (``[1, ...]`` or ``[...]``); None otherwise."""
    if full.ndim == 0 or full.shape[0] < 2 or tuple(shape) not in ((1, *full.shape[1:]), full.shape[1:]):
        return None
    if not all(np.array_equal(full[0], full[r], equal_nan=True) for r in range(1, full.shape[0])):
        return None
    return full[:1].reshape(shape)


def recorded_grads(raw: dict, side: str, mapping: dict[str, str]) -> dict[str, np.ndarray]:
    """A model port's first gradient as its optimizer was given it (the pmap side's after its pmean,
    from device 0), by NNX parameter path; {} when not observed (a loop port)."""
    record = raw.get(side, {}).get(GRADS)
    if record is None:
        return {}
    names = [mapping.get(n, n) for n in record.names] if side == 'legacy' else list(record.names)
    return dict(zip(names, record.values[min(record.values)][1], strict=True))
