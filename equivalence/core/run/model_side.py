"""A model port's two sides, built: the suite's own loops (``legacy_pmap/train.py``, ``nnx_sharded/train.py``)
over the port's models, losses and optimizer, and the NNX side's twins (``twins``) on other placements.

One seed fixes everything: the data (numpy), the linen initialisation (copied into NNX, since the two
initialisers differ) and the host key chain both paths draw call keys from.
"""

import dataclasses

import jax
import numpy as np
from flax import nnx

from equivalence.core.port.plan import Run
from equivalence.core.port.ports import ModelPort
from equivalence.core.run.facts import model_holding, uses_dropout
from equivalence.core.run.nudge import Nudged
from equivalence.core.run.setups import (
    LegacySetup,
    NnxGraphSetup,
    NnxSetup,
    legacy_loss,
    nnx_loss,
    nnx_mesh,
    nnx_step,
    port_noise,
    twin_placed_inputs,
)
from equivalence.distributed import rows
from legacy_pmap import train as legacy
from nnx_sharded import shard_map, sharding
from nnx_sharded import train as sharded


def legacy_setup(port: ModelPort, config: Run, variables: dict) -> LegacySetup:
    """pmap spans the first D devices of every process; each process replicates onto its own."""
    devices, local = jax.devices()[: config.devices], rows.local_devices(config.devices)
    tx = port.make_tx(1.0)
    pstate = legacy.replicate(legacy.create_state(variables, tx, port.ema_rate), local)
    noise = port_noise(port, uses_dropout(port))
    step = legacy.make_step_fn(
        port.legacy_model(), legacy_loss(port, config), noise, tx, port.ema_rate, config.rng_mode
    )
    return LegacySetup(legacy.make_fused_call(step, devices), pstate, config)


def model_state(port: ModelPort, variables: dict, mapping: dict, mesh, lr_scale: float, strategy: str | None = None):
    """``(graphdef, state, its shardings on mesh, placement decisions)`` of a model port's NNX side:
    its model holding linen's variables, placed by ``strategy`` (None: nothing annotated, replicated),
    its optimizer at ``lr_scale`` times the port's learning rate. The state is not placed yet."""
    model = model_holding(port, variables, mapping)
    decisions = []
    if strategy is not None:
        decisions = sharding.decide(model, strategy, mesh)
        sharding.annotate(model, decisions)
    graphdef, state = sharded.create_state(model, port.make_tx(lr_scale), port.ema_rate)
    return graphdef, state, sharding.state_shardings(graphdef, state, mesh), decisions


def new_setup(port: ModelPort, config: Run, variables: dict, mapping: dict) -> NnxSetup | NnxGraphSetup:
    """The NNX side placed by ``config.strategy`` (``nnx_sharded/sharding.py``), in ``config.nnx_form``.

    The step is the same for every strategy: only the annotations on the parameters change.
    """
    mesh = nnx_mesh(config)
    scale = 1.0 + config.perturb
    graphdef, state, shardings, decisions = model_state(port, variables, mapping, mesh, scale, config.strategy)
    state = sharding.place_state(state, shardings)
    noise = port_noise(port, uses_dropout(port))
    if config.nnx_form == 'graph':
        update = sharded.make_update_fn(nnx_loss(port, config), noise, port.ema_rate, config.rng_mode)
        ts = nnx.merge(graphdef, state)
        return NnxGraphSetup(sharded.make_graph_call(update), ts, mesh, config, decisions)
    if config.strategy == 'shard_map':
        step = shard_map.make_step_fn(graphdef, nnx_loss(port, config), noise, port.ema_rate, config.rng_mode)
        fused = shard_map.make_fused_call(step, mesh, config.rng_mode)
        return NnxSetup(fused, graphdef, state, mesh, config, decisions)
    carry_shardings = (sharding.key_sharding(mesh, config.rng_mode), shardings)
    fused = sharded.make_fused_call(nnx_step(port, graphdef, config), carry_shardings)
    return NnxSetup(fused, graphdef, state, mesh, config, decisions)


# -- the twins ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reordered:
    """A twin on the checked run's own D devices, placed by ``strategy``, whose global batch holds its
    rows interleaved (``rows``): every device sums other examples, in another order. The twin of a
    sharded strategy, whose model may fit only sharded: it holds about what a device of the run holds
    (``footprint``)."""

    strategy: str  # the run's own (its mesh too), or another placement of the same devices

    def rows(self, g: int, data: int) -> np.ndarray:
        """Position i of the twin's batch holds example ``rows[i]``: with k groups (the mesh's data axis,
        else 2), the examples of group c are spread over positions c, c + k, c + 2k, ..."""
        k = next((k for k in (data, 2) if k > 1 and g % k == 0), 1)
        return np.arange(g).reshape(k, g // k).T.ravel()

    def __str__(self) -> str:
        return f'{self.strategy}, batch rows interleaved'


TwinKind = int | Reordered | Nudged  # a twin: data parallel on that many devices, the run's devices placed and
# reordered, or the run's own program from inputs one spacing off


@dataclasses.dataclass
class TwinSetup(NnxSetup):
    """A model port's twin: the suite's split-state loop on the twin mesh, keys of the checked run."""

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        rng, (keys, batch) = twin_placed_inputs(self, rng, batch_KxG)
        return rng, ((keys, self.state), batch)


@dataclasses.dataclass
class ReorderedSetup(TwinSetup):
    """A ``Reordered`` twin: the batch's rows taken in ``rows`` order, the noise drawn for them too."""

    rows: np.ndarray | None = None

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        return super().call_args(rng, jax.tree.map(lambda v: np.asarray(v)[:, self.rows], batch_KxG))


def reordered_loss(loss, rows: np.ndarray):
    """The port's NNX loss given the noise of each example it holds: the step draws the noise by position
    (``draw_noise``), and the twin's position i holds example ``rows[i]``. (Taking it costs temporaries:
    cnn under fsdp at D = 8, global keys, 1.10x the run's bytes per device; per-device keys 1.00x.)"""
    g = len(rows)

    def loss_of_rows(model, batch, noise):
        return loss(model, batch, jax.tree.map(lambda a: a[rows] if a.ndim and a.shape[0] == g else a, noise))

    return loss_of_rows


def reordered_setup(port: ModelPort, config: Run, variables: dict, mapping: dict, kind: Reordered, scale):
    """The NNX side on the checked run's devices placed by ``kind.strategy``, its batch rows interleaved."""
    if kind.strategy != config.strategy:  # another placement of the same devices, its default mesh
        config = dataclasses.replace(config, strategy=kind.strategy, mesh=None)
    mesh = nnx_mesh(config)
    graphdef, state, shardings, _ = model_state(port, variables, mapping, mesh, scale, config.strategy)
    rows_ = kind.rows(config.batch_size, mesh.shape.get(sharding.DATA, 1))
    loss = reordered_loss(nnx_loss(port, config), rows_)
    step = sharded.make_step_fn(graphdef, loss, port_noise(port, uses_dropout(port)), port.ema_rate, config.rng_mode)
    fused = sharded.make_fused_call(step, (sharding.replicated(mesh), shardings))
    return ReorderedSetup(fused, graphdef, sharding.place_state(state, shardings), mesh, config, rows=rows_)


def twin_setup(port: ModelPort, config: Run, variables: dict, mapping: dict, twin: TwinKind, lr_scale=None):
    """The NNX side on a 1-D data mesh of ``twin`` devices (or ``Reordered``: on the run's own), with the
    checked run's config (and so its keys and ``--perturb``). ``lr_scale`` replaces ``1 + perturb``:
    tests only, a twin whose math differs, which the verdict must refuse."""
    scale = 1.0 + config.perturb if lr_scale is None else lr_scale
    if isinstance(twin, Reordered):
        return reordered_setup(port, config, variables, mapping, twin, scale)
    mesh = sharding.make_mesh(twin, devices=jax.local_devices())  # this process's own: no collective
    graphdef, state, shardings, _ = model_state(port, variables, mapping, mesh, scale)  # a data mesh: none annotated
    state = sharding.place_state(state, shardings)
    fused = sharded.make_fused_call(nnx_step(port, graphdef, config), (sharding.replicated(mesh), shardings))
    return TwinSetup(fused, graphdef, state, mesh, config)
