"""Each side's inputs as the run places them, shapes only: what the pre-flight traces the run's own programs from.

JAX keeps a trace keyed by the function and its arguments' abstract values (shape, dtype, weak type, and the mesh
and placement of a sharded array). The pre-flight traces the very functions the run then lowers or calls (the pmap
side's program, one per port: ``adapters.one_step``, ``adapters.fused_call``; the new side's own step), from
arguments that hold what the run's will hold, so that the run finds the pre-flight's trace and traces nothing again
(a ViT at 2e5 parameters: about 3.4 of the 6 s of tracing both steps twice). The arrays the run makes from the data
(its batches, keys) are made here as the run makes them, by the setup's own ``call_args`` from one call's data;
only the train states, which need linen's initial weights, are shapes (``replicas``, ``placed``). A new train state's
static fields are part of the key too (an optax transformation ``new_state`` makes afresh each time): the run's new
train state takes the structure the pre-flight traced (``traced_with``, ``adopted``), as the twins take the run's.
Where an abstract value differs from what the run holds after all, JAX traces the run's call again: slower, never
wrong.
"""

import weakref
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equivalence.core.port.plan import Run
from equivalence.core.run import freshness
from equivalence.core.state import new_side
from equivalence.distributed import rows
from nnx_sharded import sharding

SDS = jax.ShapeDtypeStruct


def replicas(state: Any, config: Run, axis_name: str) -> Any:
    """One replica's train state (shapes) as ``legacy.replicate`` places it on this process's devices: a leading
    axis of them, each leaf as its ``_copies`` makes it (JAX's dtype, not weakly typed), on a mesh of those devices
    over ``axis_name`` (with several processes flax's placement, left unsaid: the run traces again)."""
    local = rows.local_devices(config.devices)
    placed = NamedSharding(Mesh(np.asarray(local), (axis_name,)), P(axis_name)) if jax.process_count() == 1 else None

    def leaf(s):
        key = jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key)
        dtype = s.dtype if key else jax.dtypes.canonicalize_dtype(s.dtype)
        return SDS((len(local), *np.shape(s)), dtype, sharding=placed)

    return jax.tree.map(leaf, state)


def placed(tree: Any, mesh) -> Any:
    """A new train state's leaves (shapes, or Python scalars) as ``sharding.place_objects`` places them on ``mesh``:
    replicated, a Python scalar a weakly typed array as ``jax.jit`` makes it."""
    rep = sharding.replicated(mesh)

    def leaf(x):
        if isinstance(x, int | float | complex):
            a = jax.numpy.asarray(x)
            return SDS((), a.dtype, weak_type=True, sharding=rep)
        return SDS(np.shape(x), x.dtype, weak_type=bool(getattr(x, 'weak_type', False)), sharding=rep)

    return jax.tree.map(leaf, tree)


def of(tree: Any) -> Any:
    """The arrays of ``tree`` as shapes, each with its placement and weak type (what JAX keys a trace by)."""
    return jax.tree.map(lambda x: SDS(np.shape(x), x.dtype, weak_type=jax.typeof(x).weak_type,
                                      sharding=getattr(x, 'sharding', None)), tree)  # fmt: skip


def concrete(tree: Any) -> bool:
    """Whether ``tree`` holds arrays (one call's data), not shapes alone."""
    return not any(isinstance(x, SDS) for x in jax.tree.leaves(tree))


_TRACED: dict[int, tuple[weakref.ref, Any]] = {}  # id(port) -> (the port, the new train state's structure traced)
freshness.kept(_TRACED.clear)


def traced_with(port: Any, train_state: Any) -> None:
    """The pre-flight traced the port's new step over ``train_state`` (shapes), to the end: its structure is the
    one every new train state of this port takes (``adopted``). A static field that held a value of that trace
    (a tracer) would have failed the trace, where the step reads it."""
    key = id(port)
    _TRACED[key] = (weakref.ref(port, lambda _, key=key: _TRACED.pop(key, None)), new_side.structure(train_state))


def adopted(port: Any, train_state: Any) -> Any:
    """``train_state`` (the run's, built by ``new_state``) under the structure the pre-flight traced, where it
    traced one of this port (``new_side.restructured``: its own where they differ)."""
    held = _TRACED.get(id(port))
    if held is None or held[0]() is not port:
        return train_state
    return new_side.restructured(train_state, held[1])
