"""The twin: the NNX side run again, on the same data, keys and initial state, on another mesh.

Only the order of the float32 reductions changes. In per-device mode the NNX step draws
its noise by vmapping over the ``[D, 2]`` key array inside one global program
(``nnx_sharded/train.py: draw_noise``), so the key layout D does not have to be the mesh
size: a twin on D' devices given the same ``[D, 2]`` keys draws bitwise the same numbers.
In global mode the keys do not depend on D at all. So ``|nnx - twin|`` is, leaf by leaf,
what reordering the sums alone does to this port: its noise floor.

The twin is unsharded data parallelism (``dp``, split form) on D' devices whatever the
checked run's strategy or form: on one device every strategy computes the same math, and
that single-device program is the reference order. D' = 1 when D > 1: NNX on 8 devices
against NNX on 1 reproduces the 4.95e-6 that the cnn workload's ``conv1/kernel`` differs by
(``--rng global --seed 3``); NNX on 2 against 1 differs by 1.2e-7 and would miss it. When
D = 1 the twin takes 2 devices if the batch splits over them.

With several processes every process runs the same twin on its own first device(s)
(``jax.local_devices()``), on the whole batch (``setups.global_calls``): no collective, so
no process waits on another, and every process measures the same floor and so reaches the
same verdict (the worker's exit codes must agree).
"""

import dataclasses

import jax
from flax import nnx

from equivalence.core import convert, harness
from equivalence.core.config import RunConfig
from equivalence.core.ports import LoopPort, Port
from equivalence.distributed import gather
from nnx_sharded import sharding
from nnx_sharded import train as sharded


def twin_devices(config: RunConfig, available: int) -> int | None:
    """D' for a run on D devices: 1 when D > 1, else 2 if there are 2 and the batch splits; None: no twin."""
    if config.devices > 1:
        return 1
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
    mesh = sharding.make_mesh(n_twin, devices=jax.local_devices())  # this process's own: no collective
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


def run_twin(
    port: Port, config: RunConfig, variables: dict, calls: list, rng, n_twin: int, lr_scale=None, restore=None
):
    """The twin's ``PathResult``: its final state, per-step losses and parameters after each call.
    ``calls`` hold the whole batch; ``restore(setup) -> rng``, if given, loads the checkpoint the
    checked run resumed from (``--resume-at``) onto the twin's mesh, and ``calls`` follow it.
    With several processes, every process's result is process 0's (``gather.from_process_0``)."""
    setup = twin_setup(port, config, variables, n_twin, lr_scale)
    if restore is not None:
        rng = restore(setup)
    losses, per_call = harness._train(setup, calls, rng, None, harness._silent, 'twin')
    final, losses, metrics = gather.from_process_0((setup.neutral(), losses, harness._metrics(setup)))
    result = harness.PathResult(final, losses, per_call, None, mesh=dict(setup.mesh.shape))
    result.metrics = metrics
    return result
