"""Every placement decision of the sharded path: mesh, PartitionSpecs, data and state.

The train step knows nothing of devices. A parallelism strategy is a placement: this
module says where each array lives, and XLA's partitioner derives the communication
(the gradient all-reduce of data parallelism, the weight all-gathers of FSDP, the
partial-sum all-reduces of tensor parallelism) from it.

A strategy is a rule from a parameter (its path, shape, and for tensor parallelism its
place among the model's Linear layers) to a ``PartitionSpec``. The rule's answer is
attached to the parameter as Flax's own sharding annotation, the ``out_sharding``
metadata that ``nnx.with_partitioning`` writes: ``nnx.Optimizer`` and ``nnx.clone`` (the
EMA) inherit it, and ``nnx.get_partition_spec`` reads it back for the whole train state.
The model code is not touched, so a user's unannotated port takes every strategy.
A dimension that the mesh axis does not divide stays whole (replicated), and the
decision is returned as a note for the report: never silently.
"""

import contextlib
import contextvars
import dataclasses
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = 'data'  # the mesh axis the global batch is split over (and FSDP shards parameters over)
MODEL = 'model'  # the mesh axis tensor parallelism splits Linear kernels over
STRATEGIES = ('dp', 'fsdp', 'tp', 'fsdp-tp', 'shard_map')


def mesh_shape(strategy: str, n_devices: int, shape: dict[str, int] | None = None) -> dict[str, int]:
    """The mesh axes of a strategy on ``n_devices``: ``tp`` is a 1-D model axis, ``fsdp-tp``
    a 2-D ``data x model`` mesh (``shape``, default ``data=D/2, model=2``), the rest 1-D data."""
    if strategy == 'tp':
        return {MODEL: n_devices}
    if strategy == 'fsdp-tp':
        return dict(shape) if shape else {DATA: max(n_devices // 2, 1), MODEL: min(n_devices, 2)}
    return {DATA: n_devices}


def make_mesh(n_devices: int, shape: dict[str, int] | None = None, devices: list | None = None) -> Mesh:
    """A mesh over the first ``n_devices`` of ``devices`` (default ``jax.devices()``, every process's);
    1-D over ``data`` unless ``shape`` says otherwise.

    ``AxisType.Auto``: shardings flow from the placed inputs through ``jit`` and the
    partitioner fills in the rest. ``jax.make_mesh``'s default, ``Explicit``, makes every
    intermediate's sharding part of its type and requires ``jax.set_mesh`` (and an
    ``out_sharding`` on every row-parallel matmul); Auto keeps the step free of placement.
    """
    shape = shape or {DATA: n_devices}
    devices = (jax.devices() if devices is None else devices)[:n_devices]
    auto = (AxisType.Auto,) * len(shape)
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=auto, devices=devices)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Where one parameter (or batch statistic) goes, and why it stayed whole where it did."""

    path: str
    shape: tuple[int, ...]
    spec: P
    note: str = ''  # set when a dimension the strategy wanted split stayed whole


def _linear_kernels(model: nnx.Module) -> list[str]:
    """Paths of the Linear kernels in the order the model defines them (``__init__`` order)."""
    out = []

    def walk(node, prefix: str):
        if isinstance(node, nnx.Linear):
            out.append(f'{prefix}kernel')
            return
        items = vars(node).items() if isinstance(node, nnx.Module) else enumerate(node)
        for name, child in items:
            if isinstance(child, nnx.Module | list | tuple) and not str(name).startswith('_'):
                walk(child, f'{prefix}{name}/')

    walk(model, '')
    return out


def _want(strategy: str, path: str, shape: tuple[int, ...], tp: dict[str, str], mesh: Mesh) -> list:
    """The axis each dimension should be split over; a ``None`` where a wanted split does not divide."""
    want = [None] * len(shape)
    if strategy in ('tp', 'fsdp-tp') and path in tp:  # Megatron: column-parallel, then row-parallel, in turn
        want[{'column': len(shape) - 1, 'row': 0}[tp[path]]] = MODEL
    if strategy in ('fsdp', 'fsdp-tp') and shape:  # ZeRO-3: every parameter split over the data axis
        free = [d for d in range(len(shape)) if want[d] is None]
        fits = [d for d in free if shape[d] % mesh.shape.get(DATA, 1) == 0]
        if fits or free:
            want[max(fits or free, key=lambda d: shape[d])] = DATA
    return want


def _tp_roles(model: nnx.Module) -> dict[str, str]:
    """Linear kernels alternate column- and row-parallel in the order the model defines them;
    a column-parallel layer's bias is split with its outputs, a row-parallel one's stays whole."""
    roles = {}
    for i, kernel in enumerate(_linear_kernels(model)):
        roles[kernel] = 'column' if i % 2 == 0 else 'row'
        if i % 2 == 0:
            roles[kernel[: -len('kernel')] + 'bias'] = 'column'
    return roles


def decide(model: nnx.Module, strategy: str, mesh: Mesh) -> list[Decision]:
    """The spec of every parameter and batch statistic of ``model`` under ``strategy``."""
    tp = _tp_roles(model)
    decisions = []
    for path, var in _variables(model):
        shape = tuple(var.shape)
        want = _want(strategy, path, shape, tp, mesh) if strategy not in ('dp', 'shard_map') else []
        spec, notes = [], []
        for dim, axis in enumerate(want):
            if axis is not None and axis in mesh.shape and shape[dim] % mesh.shape[axis]:
                notes.append(f'dim {dim} ({shape[dim]}) stays whole: {axis}={mesh.shape[axis]} does not divide it')
                axis = None
            spec.append(axis if axis in mesh.shape else None)
        decisions.append(Decision(path, shape, P(*spec), '; '.join(notes)))
    return decisions


def _variables(model: nnx.Module) -> list[tuple[str, nnx.Variable]]:
    return [
        ('/'.join(str(k) for k in path), var)
        for path, var in nnx.iter_graph(model)
        if isinstance(var, nnx.Param | nnx.BatchStat)
    ]


def annotate(model: nnx.Module, decisions: list[Decision]) -> None:
    """Write each decision as the variable's ``out_sharding`` (what ``nnx.with_partitioning`` sets).

    ``eager_sharding=False``: the arrays stay where they are until ``place_state`` puts the
    whole train state on the mesh at once; the optimizer and EMA copies inherit the metadata.
    """
    by_path = {d.path: d for d in decisions}
    for path, var in _variables(model):
        var.set_metadata(out_sharding=tuple(by_path[path].spec), eager_sharding=False)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def state_shardings(graphdef: Any, state: Any, mesh: Mesh) -> Any:
    """The sharding of every leaf of a split train state (a plain dict), read from the
    ``out_sharding`` annotations (``nnx.get_partition_spec``); unannotated leaves are replicated."""
    specs = nnx.get_partition_spec(nnx.state(nnx.merge(graphdef, state)))
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), nnx.to_pure_dict(specs))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``[K, G, ...]``: steps stay whole, the global batch G is split over the data axis
    (and copied across the model axis: tensor parallelism gives every model shard all rows)."""
    return NamedSharding(mesh, P(None, DATA) if DATA in mesh.shape else P())


def key_sharding(mesh: Mesh, rng_mode: str) -> NamedSharding:
    """per-device keys ``[D, 2]``: row d lives on device d of a 1-D data mesh; otherwise,
    and for one global key, everywhere (the per-device draw needs only the values)."""
    one_d_data = tuple(mesh.shape) == (DATA,)
    return NamedSharding(mesh, P(DATA)) if rng_mode == 'per-device' and one_d_data else replicated(mesh)


def put(x: jax.Array | np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``jax.device_put`` that also places onto devices of other processes: every process holds
    the same value (one seed), hands over all of it, and JAX keeps its devices' parts.
    (``device_put`` refuses a committed array or a typed key for devices it cannot address.)"""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed keys travel as their key data
        return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    return jax.make_array_from_process_local_data(sharding, np.asarray(x), np.shape(x))


def place_state(state: Any, shardings: Any) -> Any:
    return jax.tree.map(put, state, shardings)


def place_objects(train_state: Any, mesh: Mesh) -> Any:
    """NNX objects (a model, an ``nnx.Optimizer``, a tuple of them) or plain arrays, replicated; a Python
    scalar leaf (a flax ``TrainState.create``'s ``step`` outside ``jax.jit`` is the int 0) an array, as the
    team's ``jax.jit`` hands it to their step (weakly typed; flax's lm1b_nnx schedule raises on a Python 0).

    Every NNX object is a pytree in flax 0.12 (``nnx.Module`` and ``nnx.Optimizer`` derive from
    ``nnx.Pytree``), so one ``jax.tree.map`` returns the same structure holding placed arrays."""
    return jax.tree.map(lambda x: _scalar(x, mesh) if isinstance(x, int | float | complex) else
                        put(x, replicated(mesh)), train_state)  # fmt: skip


def _scalar(x: int | float | complex, mesh: Mesh) -> jax.Array:
    """A Python scalar as ``jax.jit`` makes it, a weakly typed array, replicated (several processes: ``put``'s)."""
    array = jax.numpy.asarray(x)
    return jax.device_put(array, replicated(mesh)) if jax.process_count() == 1 else put(array, replicated(mesh))


def place_batch(batch_KxG: Any, mesh: Mesh) -> Any:
    """This process's rows of the global batch (all of them, with one process) -> the global
    ``[K, G, ...]`` array: each process hands over only the rows its devices hold."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharding(mesh), x), batch_KxG)


def place_keys(keys: jax.Array, mesh: Mesh, rng_mode: str) -> jax.Array:
    """Every process holds the same keys (one host key chain); each device takes its row. Rows that
    do not split over the mesh (a twin on 2 devices given the ``[1, 2]`` keys of a run on 1) are
    copied to every device instead: the per-device draw needs only their values."""
    sharding = key_sharding(mesh, rng_mode)
    if sharding.spec and keys.shape[0] % mesh.shape[DATA]:
        sharding = replicated(mesh)
    return put(keys, sharding)


# -- where data parallelism's gradient all-reduce goes ------------------------------------------

DOT_LAYERS = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)  # their ``kernel`` meets the batch in a dot_general
_PLACE_ALL_REDUCE = contextvars.ContextVar('place_all_reduce', default=True)


@contextlib.contextmanager
def partitioner_places_all_reduce():
    """Steps traced inside get the plain gradient, the all-reduce where the partitioner puts it
    (before the transposes): the form before the fix, which ``equivalence.bench`` times beside it."""
    token = _PLACE_ALL_REDUCE.set(False)
    try:
        yield
    finally:
        _PLACE_ALL_REDUCE.reset(token)


def value_and_grad(loss_fn: Callable) -> Callable:
    """``nnx.value_and_grad(loss_fn, has_aux=True)``, with data parallelism's gradient all-reduce
    placed *after* each kernel gradient's transpose, where ``pmean`` puts it in pmap code.

    Why: JAX differentiates ``x @ W`` into ``transpose(dot(g, x))``. In pmap code the ``pmean``
    follows the transpose and XLA folds the transpose into the dot. In one partitioned program the
    partitioner all-reduces the dot's partial sum at once, so the transpose is left behind the
    all-reduce, unfolded: one transposing copy per kernel per Adam moment, every step (6 on
    ``wide``). Placing the kernels *reduced* over the data axis while the gradient is formed
    (JAX's sharding-in-types: a reduced primal has an unreduced cotangent, reduced by the cast's
    transpose) moves the all-reduce behind the transpose: no transposes, same sums.

    Applies when the batch is placed on a mesh whose data axis is Auto and every parameter is
    replicated (data parallelism); otherwise it is the plain gradient. So it is too when the model
    does not trace in explicit mode (a class token ``concatenate``d with the batch's patches: one
    operand replicated, the other split over the batch). That fallback changes no number, only
    where the all-reduce runs; it is not a warning on the user's run but a line that
    ``take_fallbacks`` hands to ``equivalence.bench`` and ``equivalence.explain``.
    """
    plain = nnx.value_and_grad(loss_fn, has_aux=True)

    def grad(model: nnx.Module, batch, noise):
        mesh = _mesh_of(batch)
        if not _data_parallel(model, mesh):
            return plain(model, batch, noise)
        try:
            with jax.sharding.use_abstract_mesh(mesh):  # explicit_axes reads the context mesh
                return _reduced_value_and_grad(loss_fn, model, batch, noise)
        except Exception as e:  # noqa: BLE001 -- a bug in the loss raises again just below, in plain
            out = plain(model, batch, noise)
            _fallbacks[fallback_line(e)] = None
            return out

    return grad


_fallbacks: dict[str, None] = {}  # why the placement above fell back, per step traced since the last take


def take_fallbacks() -> list[str]:
    """Why the gradient's all-reduce stayed before the kernel transposes, for every step traced since
    the last call (in order, without repeats): the lines ``bench`` and ``explain`` print."""
    lines = list(_fallbacks)
    _fallbacks.clear()
    return lines


def fallback_line(error: BaseException) -> str:
    """One line: what explicit mode refused, where in the model's code, and what it costs."""
    text = str(error).split('. ')[0].split('\n')[0][:160]
    frames = [f for f in traceback.extract_tb(error.__traceback__) if _outside(f.filename)]
    where = f' at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}' if frames else ''
    return (
        'gradient all-reduced before the kernel transposes (where the partitioner puts it; same sums, the transposes '
        f'run as copies): the model does not trace with its batch in explicit sharding mode ({type(error).__name__}: '
        f'{text}{where})'
    )


def _outside(filename: str) -> bool:
    """A frame of the model's own code: not this module, not an installed library, not Python's."""
    return filename != __file__ and 'site-packages' not in filename and not filename.startswith(sys.base_prefix)


def _mesh_of(batch) -> jax.sharding.AbstractMesh:
    """The context mesh, else the one the batch was placed on: under ``jit`` with Auto axes a
    tracer's type keeps the mesh of its input (not an accurate spec); unplaced input: empty."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty:
        return context
    mesh = jax.typeof(jax.tree.leaves(batch)[0]).sharding.mesh
    return getattr(mesh, 'abstract_mesh', mesh)


def _data_parallel(model: nnx.Module, mesh: jax.sharding.AbstractMesh) -> bool:
    """A mesh with an Auto data axis of size > 1, every parameter replicated, and at least one
    kernel of a dot layer: the case where moving the all-reduce removes transposes."""
    if not _PLACE_ALL_REDUCE.get() or mesh.empty or mesh.shape.get(DATA, 1) == 1:
        return False
    if dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[DATA] != AxisType.Auto:  # shard_map: Manual
        return False
    specs = [var.get_metadata().get('out_sharding') or () for _, var in _variables(model)]
    has_kernel = any(isinstance(node, DOT_LAYERS) for _, node in nnx.iter_graph(model))
    return has_kernel and all(axis is None for spec in specs for axis in spec)


def _reduced_value_and_grad(loss_fn: Callable, model: nnx.Module, batch, noise):
    """The gradient in explicit mode over the data axis, the dot layers' kernels cast to reduced."""
    graphdef, state = nnx.split(model)

    def cast_then_loss(m: nnx.Module, batch, noise):
        for _, node in nnx.iter_graph(m):
            if isinstance(node, DOT_LAYERS):
                kernel = node.kernel[...]
                node.kernel[...] = jax.reshard(kernel, P(*[None] * kernel.ndim, reduced={DATA}))
        return loss_fn(m, batch, noise)

    def explicit(state, batch, noise):
        m = nnx.merge(graphdef, state)
        out, grads = nnx.value_and_grad(cast_then_loss, has_aux=True)(m, batch, noise)
        return out, grads, nnx.state(m, nnx.Not(nnx.Param))  # batch statistics updated in place

    g = jax.tree.leaves(batch)[0].shape[0]
    rows = lambda tree: jax.tree.map(lambda a: P(DATA) if a.ndim and a.shape[0] == g else P(), tree)  # noqa: E731
    specs = (jax.tree.map(lambda _: P(), state), rows(batch), rows(noise))
    out, grads, rest = jax.sharding.explicit_axes(explicit, axes=DATA, in_sharding=specs)(state, batch, noise)
    nnx.update(model, rest)
    return out, grads
