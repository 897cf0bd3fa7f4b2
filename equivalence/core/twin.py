"""The twin: the NNX side run again, on the same data, keys and initial state, on another mesh.

Only the order of the float32 reductions changes. In per-device mode the NNX step draws
its noise by vmapping over the ``[D, 2]`` key array inside one global program
(``nnx_sharded/train.py: draw_noise``), so the key layout D does not have to be the mesh
size: a twin on D' devices given the same ``[D, 2]`` keys draws bitwise the same numbers.
In global mode the keys do not depend on D at all. So ``|nnx - twin|`` is, leaf by leaf,
what reordering the sums alone does to this port: its noise floor.

The twin is unsharded data parallelism (``dp``, split form) on D' devices whatever the
checked run's strategy or form: on one device every strategy computes the same math, and
that single-device program is the reference order. The twin must sum the batch in another
order than the checked run, the way the pmap run does: what moves a leaf is how the batch's
gradient is split into partial sums, and that is the data axis of the mesh.

- A data axis of more than 1 (dp, fsdp, fsdp-tp, shard_map on D > 1): D' = 1. NNX on 8
  devices against NNX on 1 reproduces the 4.95e-6 that the cnn workload's ``conv1/kernel``
  differs by (``--rng global --seed 3``); NNX on 2 against 1 differs by 1.2e-7 and would miss it.
- A data axis of 1 (tp: a 1-D model mesh; fsdp-tp on 2 devices; D = 1): the checked run sums
  the batch as one device does, so a twin on 1 device sums it in the same order and measures
  too small a floor. D' = D, data parallel, the pmap run's split (D > 1), or 2 devices (D = 1)
  if the batch splits over them. Measured (cnn, Adam eps 1e-8, tp on 8, global keys, seed 6):
  ``params/hidden/kernel`` of NNX tp on 8 is 4.5e-8 from NNX on 1, 7.3e-7 from legacy on 8 and
  from NNX dp on 8; a twin on 1 device failed this correct port (ratio 16), one on 8 does not.
"""

import dataclasses

import jax
from flax import nnx

from equivalence.core import convert, harness
from equivalence.core.config import RunConfig
from equivalence.core.ports import LoopPort, Port
from nnx_sharded import sharding
from nnx_sharded import train as sharded


def twin_devices(config: RunConfig, available: int) -> int | None:
    """D' for a run on D devices: 1 when its mesh splits the batch, else D when D > 1 (the pmap run's
    split), else 2 if there are 2 and the batch splits; None: no twin."""
    data = sharding.mesh_shape(config.strategy, config.devices, config.mesh_axes).get(sharding.DATA, 1)
    if data > 1:
        return 1
    if config.devices > 1:
        return config.devices
    if available >= 2 and config.batch_size % 2 == 0:
        return 2
    return None


def twin_placed_inputs(setup, rng, batch_KxG) -> tuple[jax.Array, tuple]:
    """The checked run's keys (``config.devices`` rows in per-device mode), replicated on the twin's
    mesh, whose size may not divide them; the batch split over the twin's data axis as usual."""
    rng, keys = sharded.next_call_keys(rng, setup.config.devices, setup.config.rng_mode)
    return rng, (sharding.put(keys, sharding.replicated(setup.mesh)), sharding.place_batch(batch_KxG, setup.mesh))


@dataclasses.dataclass
class TwinSetup(harness.NnxSetup):
    """A model port's twin: the suite's split-state loop on the twin mesh, keys of the checked run."""

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        rng, (keys, batch) = twin_placed_inputs(self, rng, batch_KxG)
        return rng, ((keys, self.state), batch)


@dataclasses.dataclass
class TwinLoopSetup(harness.NnxLoopSetup):
    """A loop port's twin: the user's own fused call on the twin mesh, keys of the checked run."""

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        return twin_placed_inputs(self, rng, batch_KxG)


def twin_setup(port: Port, config: RunConfig, variables: dict, n_twin: int, lr_scale: float | None = None):
    """The NNX side on a 1-D data mesh of ``n_twin`` devices, with the checked run's config (and so
    its keys and ``--perturb``). ``lr_scale`` replaces ``1 + perturb``: tests only, a twin whose
    math differs, which the verdict must refuse."""
    mesh = sharding.make_mesh(n_twin)
    model = port.nnx_model(nnx.Rngs(0))
    convert.load_linen_variables(model, variables, harness.check_names(port, variables))
    if isinstance(port, LoopPort) and harness._adapters().adapted(port):  # a real step: its own setup
        return harness._adapters().nnx_setup(port, config, model, mesh)
    if isinstance(port, LoopPort):
        return TwinLoopSetup(port, sharding.place_objects(port.nnx_state(model), mesh), mesh, config)
    scale = 1.0 + config.perturb if lr_scale is None else lr_scale
    graphdef, state = sharded.create_state(model, port.make_tx(scale), port.ema_rate)
    shardings = sharding.state_shardings(graphdef, state, mesh)
    state = sharding.place_state(state, shardings)
    step = harness.nnx_step(port, graphdef, config)
    fused = sharded.make_fused_call(step, (sharding.replicated(mesh), shardings))
    return TwinSetup(fused, graphdef, state, mesh, config)


def run_twin(port: Port, config: RunConfig, variables: dict, calls: list, rng, n_twin: int, lr_scale=None):
    """The twin's ``PathResult``: its final state, per-step losses and parameters after each call."""
    setup = twin_setup(port, config, variables, n_twin, lr_scale)
    losses, per_call = harness._train(setup, calls, rng, None, harness._silent, 'twin')
    result = harness.PathResult(setup.neutral(), losses, per_call, None, mesh=dict(setup.mesh.shape))
    result.metrics = harness._metrics(setup)
    return result
