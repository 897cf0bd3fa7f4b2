"""Pitfall 6: ``nnx.scan(..., transform_metadata={nnx.PARTITION_NAME: 'batch'})`` over an optimizer carry.

The original question hoped this would split the batch over the 'batch' axis. It does
not, and it raises nothing. In flax 0.12.8 (``flax/nnx/transforms/iteration.py``,
``ScanFn.__call__`` and ``_update_variable_sharding_metadata``) the partition name is
applied only to graph-node states scanned with an *integer* axis: it inserts (on output)
and removes (on input) that axis name in each Variable's ``out_sharding`` metadata. It
is for scanning over *stacked layers*, whose parameters gain a leading axis. A carry,
such as the train state holding the ``nnx.Optimizer``, has no scan axis: it is skipped.

Measured below: the compiled program and the results are bitwise the same with and
without it, and a batch that was never placed on the mesh runs on one device with no
all-reduce. The right call: no ``transform_metadata``; place the batch with
``NamedSharding(mesh, P(None, 'data'))`` and the state replicated
(``nnx_sharded/sharding.py``); the partitioner then all-reduces the gradients.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from equivalence.core import harness
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.state import convert
from equivalence.pitfalls.base import CaseResult, max_abs_diff, within_tol, yes
from nnx_sharded import losses as nnx_losses
from nnx_sharded import sharding
from nnx_sharded import train as sharded

NUMBER = 6
NAME = 'scan_transform_metadata'
TITLE = 'nnx.scan transform_metadata over an optimizer carry'
DESCRIPTION = (
    "nnx.scan(step, in_axes=(nnx.Carry, 0), transform_metadata={nnx.PARTITION_NAME: 'batch'}) with the "
    'model and nnx.Optimizer in the carry, expecting the batch to be split over devices. '
    'Bites silently: it changes nothing, and an unplaced batch trains on one device.'
)


def fused_call(graphdef, transform_metadata: dict | None):
    """K steps with ``nnx.scan`` over the batch, the train state (model + optimizer) as carry."""
    extra = {} if transform_metadata is None else {'transform_metadata': transform_metadata}

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), **extra)
    def steps(ts, batch):
        loss_fn = lambda model: jnp.mean(nnx_losses.mlp_loss(model, batch, {}))  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn)(ts.model)
        ts.optimizer.update(ts.model, grads)
        return ts, loss

    def call(state, batch_KxG):
        ts, losses_K = steps(nnx.merge(graphdef, state), batch_KxG)
        return nnx.state(ts), losses_K

    return jax.jit(call)


def run_one(graphdef, meta: dict | None, state, batch_KxG) -> dict:
    """Lower, compile and run once: what the program holds, where it ran, what it returned."""
    lowered = fused_call(graphdef, meta).lower(state, batch_KxG)
    compiled = lowered.compile()
    new_state, losses_K = compiled(state, batch_KxG)
    model = nnx.merge(graphdef, new_state).model
    return {
        'program': lowered.as_text(debug_info=False),  # StableHLO without source locations
        'all_reduces': compiled.as_text().count(' all-reduce('),  # after partitioning
        'devices': len(losses_K.sharding.device_set),
        'losses_K': {'losses': jax.device_get(losses_K)},
        'params': convert.flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param))),
    }


def identical(a: dict, b: dict) -> bool:
    """The same lowered program, and bitwise the same parameters and losses."""
    same_numbers = max_abs_diff(a['params'], b['params']) == 0.0 and max_abs_diff(a['losses_K'], b['losses_K']) == 0.0
    return a['program'] == b['program'] and same_numbers


def run(devices: int) -> CaseResult:
    wl = workloads.get('mlp')
    config = RunConfig(workload='mlp', devices=devices, steps_per_call=5, calls=1, batch_size=wl.default_batch)
    fed = harness.prepare(wl, config).inputs  # the harness's own preparation (pre-flight, inputs)
    variables, calls = fed.variables, fed.calls
    model = wl.nnx_model(nnx.Rngs(0))
    convert.load_linen_variables(model, variables)
    graphdef, state = sharded.create_state(model, wl.make_tx(1.0), None)
    mesh = sharding.make_mesh(devices)
    shardings = sharding.state_shardings(graphdef, state, mesh)  # replicated: nothing annotated
    placed = (sharding.place_state(state, shardings), sharding.place_batch(calls[0], mesh))
    meta = {nnx.PARTITION_NAME: 'batch'}
    plain, wrong = run_one(graphdef, None, state, calls[0]), run_one(graphdef, meta, state, calls[0])
    fix, placed_meta = run_one(graphdef, None, *placed), run_one(graphdef, meta, *placed)
    no_effect = identical(plain, wrong) and identical(fix, placed_meta)
    fix_diff = max(max_abs_diff(plain['params'], fix['params']), max_abs_diff(plain['losses_K'], fix['losses_K']))
    fix_ok = within_tol(plain['params'], fix['params']) and within_tol(plain['losses_K'], fix['losses_K'])
    return CaseResult(
        symptom=f'no effect (program and results bitwise identical with and without it, placed or not: '
        f'{yes(no_effect)}); the unplaced batch ran on {wrong["devices"]} of {devices} devices, '
        f'{wrong["all_reduces"]} all-reduces',
        threshold='identical program and results with the metadata, and the unplaced batch on 1 device, 0 all-reduces',
        damage_shown=False,  # nothing differs: the trap is what it does not do (the batch stays on one device)
        changes_nothing=no_effect and wrong['devices'] == 1 and wrong['all_reduces'] == 0,
        fix=f'no transform_metadata, batch placed P(None, {sharding.DATA!r}): {fix["devices"]} devices, '
        f'{fix["all_reduces"]} all-reduce(s), max |diff| to the 1-device run {fix_diff:.1e}',
        fix_matches=fix['devices'] == devices and fix['all_reduces'] > 0 and fix_ok,
        details={
            'metadata_changes_nothing': no_effect,
            'unplaced': {'devices': wrong['devices'], 'all_reduces': wrong['all_reduces']},
            'placed': {'devices': fix['devices'], 'all_reduces': fix['all_reduces'], 'max_abs_diff': fix_diff},
        },
    )
