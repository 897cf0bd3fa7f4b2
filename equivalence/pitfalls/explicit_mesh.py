"""Pitfall 10: ``jax.make_mesh``'s default, ``AxisType.Explicit``, used outside ``jax.set_mesh``.

Since JAX 0.7 ``jax.make_mesh`` makes Explicit axes: an array's sharding becomes part of
its type, and operations that must resolve a sharding need the mesh in context. Placing
the batch works, an eager forward pass works, and then the eager gradient (here
``nnx.value_and_grad`` of the suite's mlp loss) raises. Two fixes, both measured: compute
inside ``with jax.set_mesh(mesh):``, or build the mesh with ``AxisType.Auto`` as
``nnx_sharded/sharding.py`` does (plain data parallelism gains nothing from Explicit).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from equivalence.core import harness
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.state import convert
from equivalence.pitfalls.base import CaseResult, first_line, max_abs_diff, within_tol, yes
from nnx_sharded import losses as nnx_losses
from nnx_sharded import sharding

NUMBER = 10
NAME = 'explicit_mesh'
TITLE = 'Explicit-axis mesh used outside jax.set_mesh'
DESCRIPTION = (
    "mesh = jax.make_mesh((D,), ('data',)) (Explicit axes by default), the batch placed on it, "
    'then an eager gradient outside jax.set_mesh. Bites in eager code (eval, debugging, tests): it raises.'
)


def value_and_grad(model: nnx.Module, batch_G: dict) -> dict[str, np.ndarray]:
    """Eager loss and gradients of the suite's mlp loss, flattened to host arrays."""
    loss_fn = lambda m: jnp.mean(nnx_losses.mlp_loss(m, batch_G, {}))  # noqa: E731
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    return {'loss': np.asarray(loss), **convert.flatten(nnx.to_pure_dict(grads))}


def placed(model_factory, batch_G: dict, mesh) -> tuple[nnx.Module, dict]:
    """A fresh model, replicated on ``mesh``, and the batch split over its data axis."""
    model = model_factory()
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    return model, jax.device_put(batch_G, NamedSharding(mesh, P(sharding.DATA)))


def run(devices: int) -> CaseResult:
    wl = workloads.get('mlp')
    config = RunConfig(workload='mlp', devices=devices, steps_per_call=1, calls=1, batch_size=wl.default_batch)
    fed = harness.prepare(wl, config).inputs  # the harness's own preparation (pre-flight, inputs)
    variables, calls = fed.variables, fed.calls
    batch_G = {k: v[0] for k, v in calls[0].items()}

    model = wl.nnx_model(nnx.Rngs(0))
    convert.load_linen_variables(model, variables)
    model_factory = lambda: nnx.clone(model)  # noqa: E731
    reference = value_and_grad(model_factory(), batch_G)  # one device, nothing placed
    explicit = jax.make_mesh((devices,), (sharding.DATA,), devices=jax.devices()[:devices])
    try:
        value_and_grad(*placed(model_factory, batch_G, explicit))
        error = None
    except Exception as e:  # noqa: BLE001 -- the point is to show whatever the user sees
        error = first_line(e)
    with jax.set_mesh(explicit):
        in_context = value_and_grad(*placed(model_factory, batch_G, explicit))
    auto = value_and_grad(*placed(model_factory, batch_G, sharding.make_mesh(devices)))
    fixes = {'inside jax.set_mesh': in_context, 'AxisType.Auto mesh': auto}
    axis_type = explicit.axis_types[0]
    return CaseResult(
        symptom=error or f'no error: an eager gradient on a {axis_type} mesh outside jax.set_mesh ran',
        threshold=f'the eager gradient on the default ({axis_type}) mesh raises outside jax.set_mesh',
        damage_shown=error is not None and axis_type == AxisType.Explicit,
        fix='; '.join(
            f'{name}: {max_abs_diff(reference, got):.1e} from 1 device, ok {yes(within_tol(reference, got))}'
            for name, got in fixes.items()
        ),
        fix_matches=all(within_tol(reference, got) for got in fixes.values()),
        details={
            'default_axis_type': str(axis_type),
            'error': error,
            **{name: max_abs_diff(reference, got) for name, got in fixes.items()},
        },
    )
