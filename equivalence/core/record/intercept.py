"""Every module call of the first step, recorded on both sides: what went in, what came out.

The first step runs once more on each side (the pmap side, NNX, and the NNX twin), through the
same loops (``run.sides``, ``twin``), from the inputs the checked runs got. Every linen module call
is intercepted (``nn.intercept_methods``) and every NNX module class's ``__call__`` wrapped (the
randomness bridge's Dropout too); a value leaves the program through ``jax.debug.callback``, so it
works inside pmap, scan, jit, grad, and (one callback above every vmap) ``vmap``, in the suite's loops
and in a loop port's own; a copy an NNX transform makes (``nnx.remat``, ``nnx.scan``) is named as its
original (``recorded.copy_path``). A model port's per-example losses (``LOSS``) and the gradients its
optimizer is given (``GRADS``, the pmap side's after its pmean) are recorded the same way.
On the pmap side each device's rows are recorded (``lax.axis_index``) and joined (``recorded.value``);
on the NNX side a value is gathered onto the run's mesh before it leaves; a ``twin.Reordered`` twin's
rows are put back in the run's order (``recorded.in_order``). What a callback is handed is kept, not
read, until the run is over: JAX puts it on CPU device 0, whose program is waiting for the callback, and
reading it there waits on a collective that waits on that device (a deadlock seen at 8 devices).
"""

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx
from jax.extend.core import get_opaque_trace_state
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from equivalence.core.port.ports import ModelPort
from equivalence.core.record.recorded import Record, copy_path, unbatched, value
from equivalence.core.rng import randomness
from equivalence.core.state.paths import key_name

LOSS, GRADS = '<loss>', '<grads>'  # recorded values that are no module's
DOUT = '<d output>'  # the cotangent of the outermost module's output: d(training loss) / d(output)
NOT_MODULES = (LOSS, GRADS, DOUT)
__all__ = ['Record', 'value', 'recording_port', 'settings']  # Record, value: recorded's


class _Session:
    """What is being recorded: one side at a time; the values arrive on JAX's callback threads."""

    def __init__(self):
        self.side: str | None = None  # 'legacy', 'new' or 'twin' while a run is recorded; None: nothing
        self.axis: str | None = None  # the legacy side's pmap axis: each device's rows are recorded
        self.mesh = None  # NNX: values are gathered onto this mesh before they leave
        self.raw: dict = {}  # side -> label -> (class, order, names, [(device, inputs, outputs)]), then Record
        self.counts: list = []  # [trace state, {path: calls so far}] per trace seen
        self.order = 0
        self.call = 0  # the recorded run's calls so far (one step each): a value is kept with its call
        self.paths: dict[int, str] = {}  # NNX: id(module) -> its path under the outermost module called
        self.copies: list = []  # NNX: the copies ``paths`` names, held so that no later object takes their id
        self.modules: list = []  # NNX: (path, module) of the outermost call's graph
        self.active: set[int] = set()  # NNX: modules whose __call__ is running
        self.linen_active: set[int] = set()  # linen: the same
        self.forward = False  # the forward pass alone: nothing recorded that the backward pass computes
        self.rows: tuple | None = None  # (rows kept a device, devices, global batch): ``sampled``; None: all rows
        self.draws: dict = {}  # side -> the digests of the random draws its recorded calls made (``draws``)


_SESSION = _Session()
_RECORDINGS = jax.make_user_context(None)  # a jit cache key: each recording's traces are its own
_SESSIONS = itertools.count(1)


def _store(label: str, cls: str, order: int, names, settings: tuple, layout: tuple, device, inputs, outputs) -> None:
    """Keep what a callback was handed, unread (see the module docstring); ``host`` reads it."""
    side = _SESSION.side
    if side is not None:
        entry = _SESSION.raw.setdefault(side, {}).setdefault(label, (cls, order, names, [], settings))
        entry[3].append((_SESSION.call, device, list(inputs), list(outputs), layout, order))


# NNX's objects, left out of a call's arrays (flax 0.10, where a reference's recorder may run, calls it Object)
_NNX_OBJECTS = (getattr(nnx, 'Pytree', None) or nnx.Object, nnx.Variable)


def _arrays(tree: Any) -> list:
    """The array leaves of a call's arguments or result (no keys, no NNX objects)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, _NNX_OBJECTS))
    return [
        x
        for x in leaves
        if isinstance(x, jax.Array | np.ndarray) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]


def _whole(x: jax.Array, mesh) -> jax.Array:
    """``x`` replicated: resharded where its axes are explicit (the NNX step's data-parallel gradient
    traces the loss in explicit mode, where a sharding constraint is an assertion), else constrained."""
    axes = jax.typeof(x).sharding.mesh
    if not axes.empty and AxisType.Explicit in axes.axis_types:
        return jax.reshard(x, PartitionSpec())
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))


def _label(path: str) -> str:
    """``path``, with ``#n`` for the module's (n+1)-th call in this trace."""
    trace = get_opaque_trace_state(convention='flax')
    entry = next((e for e in _SESSION.counts if e[0] == trace), None)
    if entry is None:
        entry = [trace, {}]
        _SESSION.counts.append(entry)
    n = entry[1].get(path, 0)
    entry[1][path] = n + 1
    return path if n == 0 else f'{path}#{n}'


IGNORED = ('name', 'axis_name')


def settings(module: Any) -> tuple:
    """A module's own scalar settings (an epsilon, a momentum, a dropout rate, a flag), by attribute name:
    what a one-constant slip in a module changes."""
    plain = (bool, int, float, str)  # IGNORED: what a pmap module and its mesh port name apart by design
    found = [
        (k, v) for k, v in vars(module).items() if isinstance(v, plain) and not k.startswith('_') and k not in IGNORED
    ]
    return tuple(sorted(found))


ROWS = 8  # the most rows of each device's batch a recorded value keeps (``sampled``)
STATISTICS = (nn.BatchNorm, nnx.BatchNorm)  # their running statistics are read from every row of their input
STATISTICS_NAMES = frozenset(c.__name__ for c in STATISTICS)  # the same, as a record on the host names its class


def first_rows(a: Any, per_device: int, keep: int = ROWS) -> Any:
    """A pmap-side value ``[B / D, ...]`` cut to its device's first ``keep`` examples; any other kept whole."""
    return a[:keep] if np.ndim(a) and np.shape(a)[0] == per_device else a


def sampled(arrays: list, levels: list, side: str | None) -> tuple[list, list, tuple]:
    """``(values, levels, groups)``: each value of a call cut to the first ``ROWS`` examples of each device's rows,
    where an axis of it is the batch (``_SESSION.rows``), so that ``recorded.value`` joins both sides' into the same
    examples: the pmap side's per-device value ``[B / D, ...]`` to its first rows; the new side's global one
    ``[G, ...]`` to the same examples (device d's first rows, in device order), one laid out over the D groups of
    rows ``[D, B / D, ...]`` (``nnx.vmap`` over each device's rows, as docs/port.md shows) to each group's first
    rows, and one group's ``[B / D, ...]`` (a Python loop over the groups) to its first rows, flagged in ``groups``
    (``recorded.host`` joins the D calls of a module called once a group). A value vmapped over (``levels``) is
    cut with its batch axes first (``recorded.batch_axes_first``), its levels said so; one a vmap does not map is
    kept whole. A ViT-B at batch 64 sent about 13 GB through the host on a TPU chip, 270 of its check's 559 s:
    what the first step computes module by module is judged on 8 examples a device, each value of them whole."""
    if _SESSION.rows is None:
        return arrays, levels, tuple(False for _ in arrays)
    keep, devices, batch = _SESSION.rows
    keep = min(keep, batch // devices)
    out = [_rows_of(a, lv, side != 'legacy', keep, devices, batch) for a, lv in zip(arrays, levels, strict=True)]
    return [a for a, _, _ in out], [lv for _, lv, _ in out], tuple(g for _, _, g in out)


def _rows_of(a: Any, levels: tuple, new: bool, keep: int, devices: int, batch: int) -> tuple[Any, tuple, bool]:
    """One value as ``sampled`` keeps it: ``(value, its levels, whether it holds one group's rows)``."""
    per_device = batch // devices
    if any(axis is None for axis, _ in levels) or not np.ndim(a):
        return a, levels, False
    for k, (axis, _) in enumerate(levels):  # each vmap's axis in front, outermost first
        a = jax.numpy.moveaxis(a, k + axis, k)
    levels = tuple((0, size) for _, size in levels)
    shape = np.shape(a)
    if not new:
        return (a[:keep], _resized(levels, 0, keep), False) if shape[0] == per_device else (a, levels, False)
    if shape[:2] == (devices, per_device):  # [D, B / D, ...], vmapped over the groups or not: each group's
        return a[:, :keep], _resized(levels, 1, keep), False
    if shape[0] == batch:  # device d's first rows, in device order
        a = a.reshape(devices, per_device, *shape[1:])[:, :keep].reshape(devices * keep, *shape[1:])
        return a, _resized(levels, 0, devices * keep), False
    if shape[0] == per_device and devices > 1:  # one group's rows
        return a[:keep], _resized(levels, 0, keep), True
    return a, levels, False


def _resized(levels: tuple, axis: int, size: int) -> tuple:
    """``levels`` (batch axes first) with the one at ``axis``, where it is a vmap's, now ``size`` long."""
    return tuple((0, size) if k == axis else level for k, level in enumerate(levels))


def _emit(label: str, cls: str, inputs: Any, outputs: Any, names: tuple | None = None, module: Any = None) -> None:
    """Send one call's inputs and outputs to the host when the program runs (at trace time)."""
    s = _SESSION
    s.order += 1
    ins, outs = _arrays(inputs), _arrays(outputs)
    try:
        device = jax.lax.axis_index(s.axis) if s.axis else 0
    except NameError:  # outside the pmap: one value
        device = 0
    said = settings(module) if module is not None else ()
    values, levels, above = unbatched([*ins, *outs])
    n_in, groups = len(ins), ()
    from jax._src import core

    with core.set_current_trace(above) if above is not None else contextlib.nullcontext():
        # above every vmap, one callback: the whole batch at once
        if s.mesh is not None:  # gathered here: a callback on a sharded value would make XLA do it, loudly
            values = [_whole(a, s.mesh) for a in values]
        if label != GRADS and not isinstance(module, STATISTICS):  # a gradient is no example's; a batch's
            values, levels, groups = sampled(values, levels, s.side)  # statistics need every row of its input
        layout = (tuple(levels[:n_in]), tuple(levels[n_in:]), groups[:n_in], groups[n_in:])
        store = functools.partial(_store, label, cls, s.order, names, said, layout)
        jax.debug.callback(store, device, values[:n_in], values[n_in:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tap(label: str, x: jax.Array) -> jax.Array:
    return x


def _tap_fwd(label: str, x: jax.Array):
    return x, None


def _tap_bwd(label: str, _, ct: jax.Array):
    try:
        _emit(label, 'cotangent', (), [ct])
    except Exception:  # noqa: BLE001 -- not recorded: the loss is then judged by the reported loss alone
        pass
    return (ct,)


_tap.defvjp(_tap_fwd, _tap_bwd)


def _tapped(out: Any) -> Any:
    """The outermost module's output unchanged; where a loss is differentiated through it, its cotangent
    (the training loss's gradient with respect to it, whatever loss the step computes) recorded as ``DOUT``."""
    if _SESSION.forward or not isinstance(out, jax.Array) or not jax.dtypes.issubdtype(out.dtype, np.floating):
        return out
    return _tap(DOUT, out)


def _linen_call(next_fun, args, kwargs, context):
    s, module = _SESSION, context.module
    # once per call: a subclass's __call__ calling its parent's (linen's SelfAttention calls
    # MultiHeadDotProductAttention's, handing it the dropout key) is the outer call's own work
    if s.side is None or context.method_name != '__call__' or id(module) in s.linen_active:
        return next_fun(*args, **kwargs)
    s.linen_active.add(id(module))
    try:
        out = next_fun(*args, **kwargs)
    finally:
        s.linen_active.discard(id(module))
    path = '/'.join(module.path)
    _emit(_label(path), type(module).__name__, (args, kwargs), out, module=module)
    return out if path else _tapped(out)


def _nnx_call(method: Callable) -> Callable:
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        s = _SESSION
        if s.side is None or id(self) in s.active:  # a subclass's __call__ calling its parent's: once
            return method(self, *args, **kwargs)
        if not s.active:  # the outermost call: every module under it by path
            s.modules = [('/'.join(map(str, p)), m) for p, m in nnx.iter_graph(self) if isinstance(m, nnx.Module)]
            s.paths, s.copies = {id(m): p for p, m in s.modules}, []
        path = s.paths.get(id(self))
        if path is None and s.active:  # a copy an NNX transform made (nnx.remat, nnx.scan): its original's
            path = copy_path(self, s.modules, s.active, s.paths)
            # held while the outermost call runs: a copy freed, its id taken by the next copy (the other MLP's
            # stack), would name that one as this one (a correct port's scanned layers not paired, in a long run)
            s.copies.extend(m for _, m in nnx.iter_graph(self) if isinstance(m, nnx.Module))
        if path is None:
            return method(self, *args, **kwargs)
        s.active.add(id(self))
        try:
            out = method(self, *args, **kwargs)
        finally:
            s.active.discard(id(self))
        _emit(_label(path), type(self).__name__, (args, kwargs), out, module=self)
        return out if path else _tapped(out)

    return call


@contextlib.contextmanager
def _patched(classes: set[type]) -> Iterator[None]:
    """Every linen call intercepted, and every NNX class's ``__call__`` (the randomness bridge's
    Dropout too, which replaces ``nnx.Dropout.__call__`` while it is active) wrapped."""
    owners = {next((c for c in cls.__mro__ if '__call__' in vars(c)), None) for cls in classes}
    saved = {c: vars(c)['__call__'] for c in owners - {None}}  # containers (nnx.List) are not called
    bridge_dropout = randomness._nnx_dropout_call
    try:
        for c, method in saved.items():
            c.__call__ = _nnx_call(method)
        randomness._nnx_dropout_call = _nnx_call(bridge_dropout)
        with nn.intercept_methods(_linen_call):
            yield
    finally:
        for c, method in saved.items():
            c.__call__ = method
        randomness._nnx_dropout_call = bridge_dropout


def _recording_tx(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx``, recording the gradients it is given (the pmap side's after its pmean)."""

    def update(grads, state, params=None, **extra):
        flat, _ = jax.tree_util.tree_flatten_with_path(grads)
        names = tuple('/'.join(key_name(k) for k in path) for path, _ in flat)
        if not _SESSION.forward:
            _emit(GRADS, 'grads', (), [leaf for _, leaf in flat], names)
        return tx.update(grads, state, params, **extra)

    return optax.GradientTransformationExtraArgs(tx.init, update)


def recording_port(port: ModelPort) -> ModelPort:
    """A model port whose losses and optimizer record what they compute (its kind's ``recording``; a
    loop port's step is its own: only its modules are seen)."""

    def legacy_loss(model, params, model_state, batch, noise):
        out = port.legacy_loss(model, params, model_state, batch, noise)
        _emit(LOSS, 'loss', (), out[0] if isinstance(out, tuple) else out)
        return out

    def nnx_loss(model, batch, noise):
        out = port.nnx_loss(model, batch, noise)
        _emit(LOSS, 'loss', (), out)
        return out

    def make_tx(lr_scale):
        return _recording_tx(port.make_tx(lr_scale))

    return dataclasses.replace(port, legacy_loss=legacy_loss, nnx_loss=nnx_loss, make_tx=make_tx, eval_data=None)
