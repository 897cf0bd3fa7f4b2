"""What a recording callback hands over, read back onto the host in the run's layout (``intercept``
records; the locator reads): a module call's values by device (``Record``), each device's rows joined
into the global batch (``value``), a value recorded under ``vmap`` put back whole (``unbatched``: one
callback above every vmap, its batch axes first), a ``Reordered`` twin's rows put back in the run's
order (``in_order``), and a copy that an NNX transform made of a module recognised by its variables'
shapes (``stacked_or_same``).
"""

from typing import Any, NamedTuple

import numpy as np
from flax import nnx


class Record(NamedTuple):
    """One call on one side (a module's, or ``LOSS`` / ``GRADS``), read back onto the host."""

    cls: str  # the module's class name
    order: int  # when the call finished, in its trace
    names: tuple | None  # GRADS: each value's parameter path
    values: dict  # device index -> (inputs, outputs): lists of host arrays
    settings: tuple = ()  # the module's own scalar settings at trace time: (name, value) pairs (``settings``)
    calls: int = 1  # how often it was called in the step on one device (a scan's iterations): values the first


def host(raw: dict, groups: int = 1) -> dict[str, Record]:
    """Every kept value read onto the host, keyed by device index: of several steps, the last; of a
    module called several times in a step on a device (each iteration of ``nn.scan`` / ``nnx.scan``, a
    forward pass recomputed by ``remat``), its first call, which nothing of the step's own calls fed
    (``Record.calls`` counts them); a value recorded under ``vmap`` with its batch axes in front,
    outermost first (``unbatched``); a module called once for each of the ``groups`` groups of rows (a new
    step's Python loop over pmap's devices' rows), its calls joined into one (``joined``). A call on one group's
    rows recorded several times a step under one label is left out: a transform traced apart (``nnx.scan``'s
    body) inside a vmap over the groups, whose callback JAX unrolls over them, or inside a loop over them, calls
    back once a group in no fixed order, and which group's rows a value holds is not known (the modules it
    feeds are compared still; left in, its rows were compared with nothing, and the modules after it unseen)."""

    def read(arrays, layouts):
        return [batch_axes_first(np.asarray(a), levels) for a, levels in zip(arrays, layouts, strict=True)]

    out, rows = {}, {}
    for label, (cls, order, names, values, settings) in raw.items():
        last = max(call for call, *_ in values)
        first: dict = {}
        counts: dict = {}
        for call, d, i, o, lay, traced in values:
            if call == last:
                d = int(np.asarray(d))
                counts[d] = counts.get(d, 0) + 1
                first.setdefault(d, (read(i, lay[0]), read(o, lay[1])))
                rows.setdefault(label, tuple(lay[2:4]))
                order = traced  # when it finished in the step's own trace
        if groups > 1 and any(sum(rows[label], ())) and counts.get(0, 0) > 1:
            continue
        out[label] = Record(cls, order, names, first, settings, max(counts.values()))
    return joined(out, rows, groups)


def joined(records: dict[str, Record], rows: dict[str, tuple], groups: int) -> dict[str, Record]:
    """A module called once for each group of rows, every call on one group's rows (``rows[label]``: ``(which
    of its values are one group's rows,)``, ``intercept.sampled``), as the calls ``path``, ``path#1`` ...
    ``path#(groups - 1)`` of a Python loop over the groups, in order: one record under ``path``, each value the
    groups' rows joined in the loop's order (group d: pmap device d's rows, as ``x.reshape(D, -1, ...)`` makes
    them), any other value the first call's. A module called another number of times is left as it is: its
    one group's rows cannot be compared with every device's, and are never paired with them."""
    calls: dict[str, list] = {}
    for label in records:
        path, _, n = label.partition('#')
        calls.setdefault(path, []).append((int(n or 0), label))
    out = dict(records)
    for path, found in calls.items():
        labels = [label for _, label in sorted(found)]
        if groups < 2 or len(labels) != groups or not all(any(sum(rows.get(x, ()), ())) for x in labels):
            continue
        parts, flags = [records[label] for label in labels], rows[labels[0]]
        ins, outs = ([_joined([p.values[0][which][i] for p in parts], flags[which][i])
                      for i in range(len(parts[0].values[0][which]))] for which in (0, 1))  # fmt: skip
        for label in labels[1:]:
            del out[label]
        out[path] = parts[0]._replace(values={0: (ins, outs)})
    return out


def _joined(values: list, rows: bool) -> np.ndarray:
    return np.concatenate(values) if rows and all(v.shape == values[0].shape for v in values) else values[0]


def batch_axes_first(x: np.ndarray, levels: tuple) -> np.ndarray:
    """``x`` as the trace above every ``vmap`` held it, each vmap's axis moved to the front (outermost
    first); a value one vmap does not map is repeated along its axis, as that vmap sees it."""
    for k, (axis, size) in enumerate(levels):
        if axis is None:
            x = np.broadcast_to(np.expand_dims(x, k), (*x.shape[:k], size, *x.shape[k:]))
        else:
            x = np.moveaxis(x, k + axis, k)
    return x


def unbatched(arrays: list) -> tuple[list, list, Any]:
    """``(values, levels, trace)``: what ``vmap`` tracers hold, whole, with each one's batch axis per vmap
    (outermost first: ``(axis or None, size)``), and the trace above every vmap, where one callback gets
    the whole batch. Under ``vmap`` (``nnx.vmap``: the forward pass vmapped over each device's rows, as
    docs/randomness.md shows; ``jax.vmap(jax.value_and_grad(...))``: each replica's gradient) a callback is
    otherwise unrolled into one per element, in no fixed order, and the elements could not be put back
    together. Without vmap: ``(arrays, [() ...], None)``. Each value is followed down through every tracer
    that wraps a value of the trace below it (``inner``), whatever the order in which ``vmap``, ``grad``,
    ``jvp``, ``linearize`` and ``remat`` were applied; JAX is pinned."""
    chains = []
    for x in arrays:
        chain = []  # (trace, axis), innermost first
        while (below := inner(x)) is not None:
            if hasattr(x, 'batch_dim'):
                chain.append((x._trace, x.batch_dim if isinstance(x.batch_dim, int) else None))
            x = below
        chains.append((x, chain))
    traces = {id(t): t for _, chain in chains for t, _ in chain}
    if not traces:
        return arrays, [() for _ in arrays], None

    def depth(t) -> int:
        n = 0
        while getattr(t, 'parent_trace', None) is not None:
            t, n = t.parent_trace, n + 1
        return n

    order = sorted(traces.values(), key=depth)  # outermost first
    values, levels = [], []
    for x, chain in chains:
        axes = {id(t): axis for t, axis in chain}
        values.append(x)
        levels.append(tuple((axes.get(id(t)), t.axis_data.size) for t in order))
    return values, levels, order[0].parent_trace


def inner(x: Any) -> Any:
    """The value a tracer wraps, of the trace below its own, or None where it wraps none (an array, the
    staging trace of ``jit`` / ``scan``, a ``shard_map``'s per-shard value). A differentiation tracer
    (``JVPTracer`` of ``jvp`` / ``jacfwd``, jax 0.10's ``LinearizeTracer`` of ``grad`` / ``vjp`` /
    ``linearize``, any tracer carrying a ``primal`` and a ``tangent``): its primal; a ``vmap``'s
    ``BatchTracer`` and a ``remat``'s ``RematTracer``: the value they carry (``val``)."""
    from jax._src import core
    from jax._src.interpreters import batching

    if not isinstance(x, core.Tracer):
        return None
    if hasattr(x, 'primal') and hasattr(x, 'tangent'):
        return x.primal
    if isinstance(x, (batching.BatchTracer, *_remat_tracer())):
        return x.val
    return None


def _remat_tracer() -> tuple[type, ...]:
    """``remat``'s tracer, where this JAX has one (jax 0.4, a reference's recorder's, has none)."""
    try:
        from jax._src.interpreters import remat
    except ImportError:
        return ()
    return (remat.RematTracer,)


def in_order(record: Record, rows: np.ndarray) -> Record:
    """A ``Reordered`` twin's record with the batch's rows put back in the run's order: its position i
    held example ``rows[i]`` (every value whose leading axis is the batch's; the gradients are sums)."""
    if record.cls == 'grads':
        return record

    def back(a: np.ndarray) -> np.ndarray:
        if a.ndim >= 2 and a.shape[0] != len(rows) and a.shape[0] * a.shape[1] == len(rows):  # [D, B / D, ...]
            return back(a.reshape(len(rows), *a.shape[2:])).reshape(a.shape)
        if a.ndim == 0 or a.shape[0] != len(rows):
            return a
        out = np.empty_like(a)
        out[rows] = a
        return out

    values = {d: ([back(a) for a in ins], [back(a) for a in outs]) for d, (ins, outs) in record.values.items()}
    return record._replace(values=values)


def value(record: Record, index: int, which: int, like: np.ndarray | None = None) -> np.ndarray:
    """Input (``which`` 0) or output (1) ``index`` of a call as the global batch: each device's rows
    in order, unless device 0's value alone has the other side's shape ``like`` and every device holds
    it (the gradients after their pmean: ``_held_alike``); laid out as ``like`` where it holds the same rows
    split over a leading axis (``[D, B / D, ...]``: a forward pass vmapped over each device's rows)."""
    per_device = [record.values[d][which][index] for d in sorted(record.values)]
    joined = np.concatenate(per_device) if len(per_device) > 1 and per_device[0].ndim else per_device[0]
    if (
        like is not None
        and joined.shape != like.shape
        and per_device[0].shape == like.shape
        and _held_alike(per_device)
    ):
        return per_device[0]
    if like is not None and joined.shape != like.shape and rows_split(joined.shape, like.shape):
        return joined.reshape(like.shape)
    return joined


def _held_alike(per_device: list) -> bool:
    """Whether every device holds the same value (a replicated one), so that device 0's is the value: not a
    device's own rows, which a new side's call on one replica's rows (diffusion_distillation's step ported as a
    Python loop over the replicas, its calls kept as the first to call back, in no set order) is not
    known to hold; paired so, another replica's time embeddings parted by 2.0 and failed a correct port."""
    return all(v.shape == per_device[0].shape and np.array_equal(v, per_device[0]) for v in per_device[1:])


def rows_split(a: tuple, b: tuple) -> bool:
    """Whether one shape is the other with its leading axis split in two (``[B, ...]``, ``[D, B / D, ...]``)."""
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return len(long_) == len(short) + 1 and len(short) > 0 and long_[0] * long_[1] == short[0] and (
        long_[2:] == short[1:])  # fmt: skip


def shapes(module: nnx.Module) -> dict[str, tuple]:
    return {
        '/'.join(map(str, p)): tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(module)) if hasattr(v, 'shape')
    }


def stacked_or_same(outer: dict, inner: dict) -> bool:
    return (
        bool(inner)
        and outer.keys() == inner.keys()
        and all(outer[k] == inner[k] or outer[k][1:] == inner[k] for k in inner)
    )


def copy_path(module: nnx.Module, modules: list, active: set, paths: dict) -> str | None:
    """The path of the module that ``module`` is a copy of, inside an NNX transform (``nnx.remat`` and
    ``nnx.scan`` call their function on modules merged anew): the one module of the outermost call's
    graph of its class whose variables have its shapes (a scanned stack's: with the stack's leading
    axis), and where several do, the one of them under the innermost module whose call is running (each of a
    NeRF's two MLPs scanning its own stack of layers of one shape); None where none or several do (not recorded,
    rather than recorded as another's). Its own submodules are named under it (in ``paths``). ``modules``:
    (path, module) of the outermost call's graph; ``active``: the modules whose call is running."""
    want = shapes(module)
    found = [
        (p, m) for p, m in modules
        if type(m) is type(module) and stacked_or_same(shapes(m), want) and id(m) not in active
    ]  # fmt: skip
    if len(found) > 1:  # alike (two MLPs' stacked layers): the one under the module whose call made the copy
        caller = max((paths[i] for i in active if i in paths), key=len, default='')
        found = [(p, m) for p, m in found if caller and p.startswith(caller + '/')]
    if len(found) != 1:
        return None
    path = found[0][0]
    for sub, m in nnx.iter_graph(module):
        if isinstance(m, nnx.Module):
            paths[id(m)] = '/'.join([path, *map(str, sub)]) if sub else path
    return path
