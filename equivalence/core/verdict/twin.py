"""The twin: the NNX side run again, on the same data, keys and initial state, on another mesh.

Only the order of the float32 reductions changes. In per-device mode the NNX step draws
its noise by vmapping over the ``[D, 2]`` key array inside one global program
(``nnx_sharded/train.py: draw_noise``), so the key layout D does not have to be the mesh
size: a twin on D' devices given the same ``[D, 2]`` keys draws bitwise the same numbers.
In global mode the keys do not depend on D at all. So ``|nnx - twin|`` is, leaf by leaf,
what reordering the sums alone does to this port: its noise floor.

The twin is unsharded data parallelism (``dp``, split form) whatever the checked run's
strategy or form. It must sum in another order than the checked run, as the pmap run does,
and no one layout does that for every strategy, so a sharded strategy gets two twins and each
leaf the larger of their floors (``farthest``):

- On 1 device (every D > 1): NNX on 8 devices against NNX on 1 reproduces the 4.95e-6 that the
  cnn workload's ``conv1/kernel`` differs by under dp (``--rng global --seed 3``); NNX on 2
  against 1 differs by 1.2e-7 and would miss it. The only twin of dp and shard_map, whose
  per-device sums are the pmap run's.
- Data parallel on D devices, the pmap run's split (fsdp, tp, fsdp-tp on D > 1): tp's mesh is
  all model axis and sums the batch as one device does, so the 1-device twin rounds like it.
  Measured (cnn, Adam eps 1e-8, global keys, seed 6): ``params/hidden/kernel`` of NNX tp on 8
  is 4.5e-8 from NNX on 1 but 7.3e-7 from legacy on 8 and from NNX dp on 8: with the 1-device
  twin alone, a false MISMATCH (16x its floor). Seed 9 the same for tp (12x) and fsdp-tp on 8
  (15x; its ``conv2/kernel`` is 3.5e-6 from NNX on 1, 4.0e-5 from legacy and NNX dp on 8).
  Neither twin alone serves fsdp everywhere: on seed 6 NNX fsdp on 8 is within 3e-8 of NNX dp
  on 8, where only the 1-device twin measures the 7.3e-7 it is from NNX on 1.
- D = 1: 2 devices, if the batch splits over them.

With several processes every process runs the same twins on its own devices
(``jax.local_devices()``; a twin needs no more of them than one process has), on the whole batch
(``setups.global_calls``): no collective, so no process waits on another, and every process
judges by process 0's twin (``gather.from_process_0``), so all reach the same verdict (the
workers' exit codes must agree). A twin that raises in one process raises in all of them
(``gather.together``), before any process waits for it to be shared.
"""

import dataclasses

import jax
import numpy as np
from flax import nnx

from equivalence.core.port import convert
from equivalence.core.port.config import RunConfig
from equivalence.core.port.ports import LoopPort, Port
from equivalence.core.run import adapters, setups, sides
from equivalence.core.verdict import compare
from equivalence.distributed import gather
from nnx_sharded import sharding
from nnx_sharded import train as sharded


def twin_counts(config: RunConfig, available: int) -> tuple[int, ...]:
    """The twins' device counts for a run on D devices: 1, and D as well for a sharded strategy;
    on D = 1, 2 if there are 2 and the batch splits; () when none fits."""
    if config.devices > 1:
        return (1,) if config.strategy in ('dp', 'shard_map') else (1, config.devices)
    return (2,) if available >= 2 and config.batch_size % 2 == 0 else ()


def farthest(nnx: compare.Neutral, twins: list[compare.Neutral]) -> compare.Neutral:
    """One twin tree whose every leaf is the twin's farthest from the NNX run's: the floor
    ``max |nnx - twin|`` of each leaf is then the larger of the twins' floors."""
    out: compare.Neutral = {}
    for g, tree in nnx.items():
        for p, a in tree.items():
            have = [t[g][p] for t in twins if p in t.get(g, {}) and t[g][p].shape == a.shape]
            if have and compare.is_float(a.dtype):  # bfloat16 too, which numpy does not call floating
                diff = lambda b, a=a: float(np.abs(a.astype(np.float64) - b).max(initial=0.0))  # noqa: E731
                out.setdefault(g, {})[p] = max(have, key=diff)
    return out


def twin_placed_inputs(setup, rng, batch_KxG) -> tuple[jax.Array, tuple]:
    """The checked run's keys (``config.devices`` rows in per-device mode), replicated on the twin's
    mesh, whose size may not divide them; the batch split over the twin's data axis as usual."""
    rng, keys = sharded.next_call_keys(rng, setup.config.devices, setup.config.rng_mode)
    return rng, (sharding.put(keys, sharding.replicated(setup.mesh)), sharding.place_batch(batch_KxG, setup.mesh))


@dataclasses.dataclass
class TwinSetup(setups.NnxSetup):
    """A model port's twin: the suite's split-state loop on the twin mesh, keys of the checked run."""

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        rng, (keys, batch) = twin_placed_inputs(self, rng, batch_KxG)
        return rng, ((keys, self.state), batch)


@dataclasses.dataclass
class TwinLoopSetup(setups.NnxLoopSetup):
    """A loop port's twin: the user's own fused call on the twin mesh, keys of the checked run."""

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        return twin_placed_inputs(self, rng, batch_KxG)


def twin_setup(port: Port, config: RunConfig, variables: dict, n_twin: int, lr_scale: float | None = None):
    """The NNX side on a 1-D data mesh of ``n_twin`` devices, with the checked run's config (and so
    its keys and ``--perturb``). ``lr_scale`` replaces ``1 + perturb``: tests only, a twin whose
    math differs, which the verdict must refuse."""
    mesh = sharding.make_mesh(n_twin, devices=jax.local_devices())  # this process's own: no collective
    model = port.nnx_model(nnx.Rngs(0))
    convert.load_linen_variables(model, variables, setups.check_names(port, variables))
    if isinstance(port, LoopPort) and adapters.adapted(port):  # a real step: its own setup
        return adapters.nnx_setup(port, config, model, mesh)
    if isinstance(port, LoopPort):
        return TwinLoopSetup(port, sharding.place_objects(port.nnx_state(model), mesh), mesh, config)
    scale = 1.0 + config.perturb if lr_scale is None else lr_scale
    graphdef, state = sharded.create_state(model, port.make_tx(scale), port.ema_rate)
    shardings = sharding.state_shardings(graphdef, state, mesh)
    state = sharding.place_state(state, shardings)
    step = setups.nnx_step(port, graphdef, config)
    fused = sharded.make_fused_call(step, (sharding.replicated(mesh), shardings))
    return TwinSetup(fused, graphdef, state, mesh, config)


def run_twin(
    port: Port, config: RunConfig, variables: dict, calls: list, rng, n_twin: int, lr_scale=None, restore=None
):
    """The twin's ``PathResult``: its final state, per-step losses and parameters after each call.
    ``calls`` hold the whole batch; ``restore(setup) -> rng``, if given, loads the checkpoint the
    checked run resumed from (``--resume-at``) onto the twin's mesh, and ``calls`` follow it.
    With several processes, every process's result is process 0's (``gather.from_process_0``), and
    an exception in one process's twin is raised in every process (``gather.together``): none waits
    for a twin that will never be shared."""
    setup = gather.together(twin_setup, port, config, variables, n_twin, lr_scale)
    if restore is not None:
        rng = gather.together(restore, setup)

    def run():
        losses, per_call = sides.run_calls(setup, calls, rng, None, sides.silent, 'twin')
        return setup.neutral(), losses, sides.loop_metrics(setup), per_call

    final, losses, metrics, per_call = gather.together(run)
    final, losses, metrics = gather.from_process_0((final, losses, metrics))
    result = sides.PathResult(final, losses, per_call, None, mesh=dict(setup.mesh.shape))
    result.metrics = metrics
    return result
