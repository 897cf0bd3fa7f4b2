"""The setups that hold each path's compiled call and state (each a ``core.port.kind.Setup``), the
rows each process feeds them, and a model port's losses wrapped for the suite's loops.

``sides`` runs them (``run_calls``); each kind of port builds its own (``model_side``, ``loop_side``,
``step_side``); ``explain`` and ``bench`` build on the same setups.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from equivalence.core.measure import footprint
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import LoopPort, ModelPort
from equivalence.core.record import pruned
from equivalence.core.rng import randomness
from equivalence.core.run.facts import uses_dropout
from equivalence.core.run.pinned import pinned_to_its_mesh
from equivalence.core.state import convert, new_side
from equivalence.distributed import gather, rows
from legacy_pmap import train as legacy
from nnx_sharded import sharding
from nnx_sharded import train as sharded


def port_noise(port: ModelPort, dropout: bool) -> Callable:
    """The step's noise function: the port's own numbers, and per-example dropout keys if needed."""

    def noise(key, spec):
        out = {'port': port.noise(key, spec) if port.noise is not None else {}}
        if dropout:
            out['dropout'] = randomness.dropout_keys(key, spec)
        return out

    return noise


def legacy_loss(port: ModelPort, config: Run) -> Callable:
    """The port's linen loss, with its Dropout layers bridged and its return normalised."""

    def loss(model, params, model_state, batch, noise):
        with randomness.bridged(config.rng_mode, legacy.AXIS, noise.get('dropout')):
            out = port.legacy_loss(model, params, model_state, batch, noise['port'])
        return out if isinstance(out, tuple) else (out, model_state)

    return loss


def nnx_loss(port: ModelPort, config: Run) -> Callable:
    def loss(model, batch, noise):
        with randomness.bridged(config.rng_mode, None, noise.get('dropout')):
            return port.nnx_loss(model, batch, noise['port'])

    return loss


def nnx_step(port: ModelPort, graphdef, config: Run) -> Callable:
    """The NNX scan body for a model port (also what bench and explain rebuild under other ``jit``s)."""
    noise = port_noise(port, uses_dropout(port))
    return sharded.make_step_fn(graphdef, nnx_loss(port, config), noise, port.ema_rate, config.rng_mode)


@dataclasses.dataclass
class LegacySetup:
    """Everything the pmap path needs before its first call."""

    p_train_step: Callable  # jax.pmap(partial(lax.scan, step)), called ((keys_D, pstate), batch_DxK)
    pstate: Any  # replicated train state, leading axis D
    config: Run
    groups: Callable = convert.legacy_groups  # one replica of the state -> {group: tree}
    context: Callable = contextlib.nullcontext  # entered around each call (a loop port's Dropout bridge)
    ready: Any = dataclasses.field(default=None, init=False)  # pruned.Program of forward's call (sides.prefetch)

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        """``(next rng, args of one call)`` in score_sde's layout; this process's devices' rows only."""
        n = self.config.devices
        rng, keys_D = legacy.next_call_keys(rng, n, self.config.rng_mode)
        keys_n, n_local = rows.local_keys(keys_D, n), len(rows.positions(n))
        batch_KxR = rows.take(batch_KxG, rows.pmap_rows(n, self.config.batch_size), input_rows(self.config))
        batch_nxK = jax.tree.map(lambda v: legacy.shard_batch(v, n_local), batch_KxR)
        return rng, ((keys_n, self.pstate), batch_nxK)

    def call(self, args: tuple) -> np.ndarray:
        """One compiled call; keeps the new state, returns the K losses (blocks: one call in flight)."""
        with self.context():
            (_, self.pstate), loss_DxK = self.p_train_step(*args)
        self.device_losses = loss_DxK  # every device's: a step that does not pmean its loss reports each its own
        return legacy.unreplicate_to_host(loss_DxK)

    def forward(self, args: tuple) -> np.ndarray:
        """The K losses of the call of ``args``, from a program of what they and its effects need (``pruned``: the
        recording's forward pass; ``ready``, traced already where it fits); the state is not updated."""
        with self.context():
            self.device_losses = pruned.call(self.p_train_step, args, pruned.LOSSES, self.ready)
        return legacy.unreplicate_to_host(self.device_losses)

    def neutral(self) -> convert.Neutral:
        return convert.groups_to_neutral(self.groups(legacy.unreplicate_to_host(self.pstate)))

    def shared(self, program: Any = None) -> Any:
        """Its compiled call, built anew with every setup; ``program``: another setup's of the same side to
        run instead (the recordings of one verdict: what JAX traced and compiled once serves them all)."""
        self.p_train_step = program or self.p_train_step
        return self.p_train_step

    def lowered(self, args: tuple) -> list:
        """The programs the call of ``args`` compiles, traced here (in its context) and none compiled: what
        a thread may compile while the other side runs (``sides.prefetch``); the call then finds them in
        JAX's cache. A pmap, or the suite's own program of a real step form (``adapters.legacy_program``)."""
        program = self.p_train_step
        with self.context():
            return [program.lower(*args)] if hasattr(program, 'lower') else program.lowered(*args)

    def traced(self, args: tuple) -> tuple:
        """``(jaxpr, output shapes)`` of what ``lowered`` lowers, traced (in its context) from ``args``, whose state
        may be shapes alone (``abstract.replicas``): the pre-flight's trace, which JAX keeps for ``lowered`` from the
        run's own arrays of the same shapes and placement (a trace is keyed by the function and those)."""
        program = self.p_train_step
        with self.context():
            if hasattr(program, 'lower'):
                return jax.make_jaxpr(program, return_shape=True)(*args)
            return program.traced(*args)


def placed_inputs(setup, rng, batch_KxG) -> tuple[jax.Array, tuple]:
    """``(next rng, (keys, batch_KxG))`` of one NNX call, placed on ``setup.mesh``."""
    mode = setup.config.rng_mode
    rng, keys = sharded.next_call_keys(rng, setup.config.devices, mode)
    held = rows.held_rows(sharding.batch_sharding(setup.mesh), setup.config.batch_size)
    batch_KxR = rows.take(batch_KxG, held, batch_rows(batch_KxG, setup.config))
    return rng, (sharding.place_keys(keys, setup.mesh, mode), sharding.place_batch(batch_KxR, setup.mesh))


@dataclasses.dataclass
class NnxSetup:
    """Everything the sharded path needs before its first call (a model port: the suite's loop)."""

    fused: Callable  # jax.jit(train.scan_steps(step)), called ((keys, state), batch_KxG) -> (carry, loss_K)
    graphdef: Any
    state: Any  # the TrainState's arrays, a plain dict (nnx.to_pure_dict), placed on the mesh
    mesh: Any
    config: Run
    decisions: list = dataclasses.field(default_factory=list)  # sharding.Decision per parameter

    model = property(lambda self: nnx.merge(self.graphdef, self.state).model)

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        rng, (keys, batch) = placed_inputs(self, rng, batch_KxG)
        return rng, ((keys, self.state), batch)

    def call(self, args: tuple) -> np.ndarray:
        (_, self.state), loss_K = self.fused(*args)
        return np.asarray(loss_K)

    def forward(self, args: tuple) -> np.ndarray:
        """The K losses alone (``LegacySetup.forward``); the state is not updated."""
        return np.asarray(pruned.call(self.fused, args, pruned.LOSSES))

    def neutral(self) -> convert.Neutral:
        return convert.nnx_to_neutral(self.graphdef, gather.to_host(self.state))

    def shared(self, program: Any = None) -> Any:
        """``LegacySetup.shared``."""
        self.fused = program or self.fused
        return self.fused

    def lowered(self, args: tuple) -> list:
        """The suite's own program of this call, traced here (``LegacySetup.lowered``)."""
        return [self.fused.lower(*args)]

    def view(self) -> nnx.Module:
        """The train state it trains, as one object (a copy: ``restored`` takes it back)."""
        return nnx.merge(self.graphdef, self.state)

    def restored(self, train_state: nnx.Module) -> None:
        """``train_state`` (its ``view``, a checkpoint loaded into it) is what it trains from now on."""
        self.state = nnx.to_pure_dict(nnx.state(train_state))


@dataclasses.dataclass
class NnxGraphSetup:
    """``--nnx-form graph``: the Flax docs' ``nnx.jit(nnx.scan)`` over the TrainState object."""

    fused: Callable  # train.make_graph_call: (ts, keys, batch_KxG) -> (keys, loss_K), ts updated in place
    ts: Any  # nnx_sharded.train.TrainState, its arrays placed on the mesh
    mesh: Any
    config: Run
    decisions: list = dataclasses.field(default_factory=list)

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        return placed_inputs(self, rng, batch_KxG)

    def call(self, args: tuple) -> np.ndarray:
        _, loss_K = self.fused(self.ts, *args)
        return np.asarray(loss_K)

    def forward(self, args: tuple) -> np.ndarray:
        """The whole call: the graph form updates its objects in place, and is not traced as one function."""
        return self.call(args)

    def shared(self, program: Any = None) -> Any:
        """``LegacySetup.shared``."""
        self.fused = program or self.fused
        return self.fused

    def neutral(self) -> convert.Neutral:
        groups = convert.nnx_groups(self.ts.model, self.ts.optimizer, self.ts.ema)
        return convert.groups_to_neutral(gather.to_host(groups))

    @property
    def model(self):
        return self.ts.model

    def view(self) -> nnx.Module:
        """The train state it trains, itself."""
        return self.ts

    def restored(self, train_state: nnx.Module) -> None:
        """Loaded in place: nothing to take back."""


@dataclasses.dataclass
class LoopNewSetup:
    """A loop port's NNX side: the user's fused call over the user's train state."""

    placed_by = "the port's own step"  # who chose ``decisions`` (a model port's: the suite's strategy)
    port: LoopPort
    train_state: Any  # whatever port.new_state returned, placed on the mesh
    mesh: Any
    config: Run

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        return placed_inputs(self, rng, batch_KxG)

    def call(self, args: tuple) -> np.ndarray:
        with randomness.bridged(self.config.rng_mode), pinned_to_its_mesh(self.port, self.mesh):
            self.train_state, losses_K = self.port.new_call(self.train_state, *args)
        return np.asarray(losses_K)

    @property
    def decisions(self) -> list[sharding.Decision]:
        """Each parameter where the team's own step left it (the suite placed it replicated): ``footprint``."""
        return footprint.placement((self.port.new_groups or new_side.read_groups)(self.train_state).get('params'))

    def forward(self, args: tuple) -> np.ndarray:
        """The K losses alone (``LegacySetup.forward``), of the call as one program (``as_pure_call``)."""
        return np.asarray(self.forward_outputs(args))

    def forward_outputs(self, args: tuple) -> Any:
        fn, state = self.as_pure_call()
        with pinned_to_its_mesh(self.port, self.mesh):
            return pruned.call(fn, (state, *args), pruned.LOSSES)

    def neutral(self) -> convert.Neutral:
        groups = self.port.new_groups or new_side.read_groups
        return convert.groups_to_neutral(gather.to_host(groups(self.train_state)))

    def shared(self, program: Any = None) -> Any:
        """Its train state's structure, or ``program``'s (another setup's) given to its arrays (``new_side``)."""
        if program is not None:
            self.train_state = new_side.restructured(self.train_state, program)
        return new_side.structure(self.train_state) if program is None else program

    def view(self) -> nnx.Module:
        """The team's train state, viewed under ``nnx_sharded.train.TrainState``'s names (``View``); with
        ``new_groups=`` its own layout (``checkpoint.layout.group_places`` maps into it)."""
        return self.train_state if self.port.new_groups is not None else View.of(self.train_state)

    def restored(self, train_state: nnx.Module) -> None:
        """Loaded in place (the view shares the team's objects): nothing to take back."""

    def as_pure_call(self) -> tuple[Callable, Any]:
        """``(jax.jit(call over split state), typed state)``: the user's call as one program whose inputs are arrays,
        so that explain can lower it and name every input. A pytree train state (``new_side``) is one as it is."""
        if new_side.form(self.train_state) == new_side.PYTREE:
            return jax.jit(self._pure_pytree_call, keep_unused=True), self.train_state
        graphdef, state = nnx.split(self.train_state)

        def pure(state, keys, batch_KxG):
            with randomness.bridged(self.config.rng_mode):
                ts, losses_K = self.port.new_call(nnx.merge(graphdef, state), keys, batch_KxG)
            return nnx.state(ts), losses_K

        return jax.jit(pure, keep_unused=True), state  # a key the call ignores is an input too (FACTS.md)

    def _pure_pytree_call(self, train_state, keys, batch_KxG):
        with randomness.bridged(self.config.rng_mode):
            return self.port.new_call(train_state, keys, batch_KxG)


def nnx_mesh(config: Run):
    return sharding.make_mesh(config.devices, sharding.mesh_shape(config.strategy, config.devices, config.mesh_axes))


def batch_rows(batch_KxR: Any, config: Run) -> rows.Rows:
    """The rows of the global batch that ``batch_KxR`` holds: all of them when it holds G (a
    global batch, as the twin is given), else those this process reads (``input_rows``)."""
    r, g = jax.tree.leaves(batch_KxR)[0].shape[1], config.batch_size
    return slice(0, g) if r == g else input_rows(config)


@functools.cache
def input_rows(config: Run) -> rows.Rows:
    """The rows of the global batch this process reads: those its pmap devices take, and those its
    devices hold of the NNX batch (all of them where the batch is copied over a ``model`` axis); one process: all."""
    g = config.batch_size  # one process, no mesh built: a reference's recorder (the pmap side alone) reads it too
    held = slice(0, g) if jax.process_count() == 1 else rows.held_rows(sharding.batch_sharding(nnx_mesh(config)), g)
    return rows.hull(rows.pmap_rows(config.devices, g), held)


def twin_placed_inputs(setup, rng, batch_KxG) -> tuple[jax.Array, tuple]:
    """The checked run's keys (``config.devices`` rows in per-device mode), replicated on the twin's
    mesh, whose size may not divide them; the batch split over the twin's data axis as usual."""
    rng, keys = sharded.next_call_keys(rng, setup.config.devices, setup.config.rng_mode)
    return rng, (sharding.put(keys, sharding.replicated(setup.mesh)), sharding.place_batch(batch_KxG, setup.mesh))


class View(nnx.Module):
    """A loop port's NNX objects under the names of ``nnx_sharded.train.TrainState`` (``model``,
    ``optimizer``, ``ema``), so that one checkpoint layout serves both levels. The view shares them:
    restoring into the view restores into the team's own model and optimizer."""

    def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer, ema: nnx.Module | None = None):
        self.model, self.optimizer, self.ema = model, optimizer, ema

    @classmethod
    def of(cls, train_state: Any) -> 'View':
        return cls(*convert.find_nnx_objects(train_state))
