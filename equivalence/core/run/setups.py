"""How each path is set up before its first call: the inputs of a run, the port's losses wrapped
for the suite's loops, and the setups that hold each path's compiled call and state.

``harness`` runs them (``run_calls``), compares what they end with and judges it; ``twin``,
``adapters``, ``explain`` and ``bench`` build on the same setups.
"""

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from equivalence.core.port import convert, naming, new_side
from equivalence.core.port.config import RunConfig
from equivalence.core.port.ports import LoopPort, ModelPort, Port, init_inputs
from equivalence.core.run import randomness
from equivalence.distributed import gather, rows
from legacy_pmap import train as legacy
from nnx_sharded import sharding
from nnx_sharded import train as sharded


def make_inputs(port: Port, config: RunConfig) -> tuple[dict, list, jax.Array]:
    """Linen variables, the data of each call (pytrees of ``[K, G, ...]``; with several processes,
    only this process's rows ``[K, G*n/D, ...]``), and the training key."""
    whole = global_calls(port, config)
    calls = [rows.local_batch(batch_KxG, config.devices, input_rows(config)) for batch_KxG in whole]
    rng, init_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    example = jax.tree.map(lambda v: v[0, :1], whole[0])
    args, kwargs = init_inputs(port, example)
    # One compiled program, not one per operation (10 of the 21 s of a cold ResNet run were op by op);
    # the pre-flight has traced this init already (abstractly), and on the built-ins it is bitwise the same.
    init = jax.jit(lambda key: port.legacy_model().init({'params': key, 'dropout': key}, *args, **kwargs))
    return dict(init(init_rng)), calls, rng


def global_calls(port: Port, config: RunConfig) -> list:
    """Every call's whole batch, ``[K, G, ...]``, in every process: what ``make_inputs`` splits
    between processes, and what a run on this process's devices alone (the twin across processes)
    is fed. ``make_data`` is seeded, so each process draws the same rows."""
    data = port.make_data(np.random.default_rng(config.seed), config.steps, config.batch_size)
    k = config.steps_per_call
    return [jax.tree.map(lambda v, c=c: v[c * k : (c + 1) * k], data) for c in range(config.calls)]


def batch_rows(batch_KxR: Any, config: RunConfig) -> rows.Rows:
    """The rows of the global batch that ``batch_KxR`` holds: all of them when it holds G (a
    global batch, as the twin is given), else those this process reads (``input_rows``)."""
    r, g = jax.tree.leaves(batch_KxR)[0].shape[1], config.batch_size
    return slice(0, g) if r == g else input_rows(config)


@functools.cache
def input_rows(config: RunConfig) -> rows.Rows:
    """The rows of the global batch this process reads: those its pmap devices take, and those its
    devices hold of the NNX batch (all of them where the batch is copied over a ``model`` axis)."""
    g, held = config.batch_size, rows.held_rows(sharding.batch_sharding(nnx_mesh(config)), config.batch_size)
    return rows.hull(rows.pmap_rows(config.devices, g), held)


def abstract_model(port: Port) -> nnx.Module | None:
    """The port's NNX model with shapes and dtypes only: what checks read, nothing allocated. None
    for a loop port without one (its new side is built from linen's variables)."""
    if port.nnx_model is None:
        return None
    return nnx.eval_shape(lambda: port.nnx_model(nnx.Rngs(0)))


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the checks read of a port's abstract NNX model (None where it has none)."""

    spec: Any  # naming.nnx_spec of it
    batch_stats: bool  # it holds nnx.BatchStat
    dropout: bool  # it holds Dropout or attention layers
    own_state: bool  # it holds what linen's variables cannot give: a random stream, an array not in a Variable


_FACTS: dict[int, tuple[weakref.ref, ModelFacts | None]] = {}


def model_facts(port: Port) -> ModelFacts | None:
    """``ModelFacts`` of the port's NNX model, built once per port object (a run asks a dozen times;
    each abstract model is an ``nnx.eval_shape`` of the whole model); None without a model."""
    held = _FACTS.get(id(port))
    if held is not None and held[0]() is port:
        return held[1]
    abstract = abstract_model(port)
    facts = None
    if abstract is not None:
        nodes = [node for _, node in nnx.iter_graph(abstract)]
        facts = ModelFacts(
            naming.nnx_spec(abstract),
            any(isinstance(node, nnx.BatchStat) for node in nodes),
            any(isinstance(node, nnx.Dropout | nnx.MultiHeadAttention) for node in nodes),
            any(isinstance(node, nnx.RngState | jax.core.Tracer | jax.ShapeDtypeStruct) for node in nodes),
        )
    key = id(port)
    _FACTS[key] = (weakref.ref(port, lambda _, key=key: _FACTS.pop(key, None)), facts)
    return facts


def check_names(port: Port, variables: dict) -> dict[str, str]:
    """``{linen path: NNX path}`` for every variable, from an abstract NNX model (nothing is
    allocated); ``naming.PortError`` (exit 2) when the two sides do not pair. Without an NNX
    model the new side keeps linen's names: ``{}``."""
    facts = model_facts(port)
    if facts is None:
        return {}
    return naming.resolve(naming.linen_spec(variables), facts.spec, port.names)


def has_batch_stats(port: Port) -> bool:
    facts = model_facts(port)
    return facts is not None and facts.batch_stats


def uses_dropout(port: Port) -> bool:
    """Whether the NNX model has Dropout or attention layers (then the suite hands both sides dropout keys)."""
    facts = model_facts(port)
    return facts is not None and facts.dropout


def port_noise(port: ModelPort, dropout: bool) -> Callable:
    """The step's noise function: the port's own numbers, and per-example dropout keys if needed."""

    def noise(key, spec):
        out = {'port': port.noise(key, spec) if port.noise is not None else {}}
        if dropout:
            out['dropout'] = randomness.dropout_keys(key, spec)
        return out

    return noise


def legacy_loss(port: ModelPort, config: RunConfig) -> Callable:
    """The port's linen loss, with its Dropout layers bridged and its return normalised."""

    def loss(model, params, model_state, batch, noise):
        with randomness.bridged(config.rng_mode, legacy.AXIS, noise.get('dropout')):
            out = port.legacy_loss(model, params, model_state, batch, noise['port'])
        return out if isinstance(out, tuple) else (out, model_state)

    return loss


def nnx_loss(port: ModelPort, config: RunConfig) -> Callable:
    def loss(model, batch, noise):
        with randomness.bridged(config.rng_mode, None, noise.get('dropout')):
            return port.nnx_loss(model, batch, noise['port'])

    return loss


def nnx_step(port: ModelPort, graphdef, config: RunConfig) -> Callable:
    """The NNX scan body for a model port (also what bench and explain rebuild under other ``jit``s)."""
    noise = port_noise(port, uses_dropout(port))
    return sharded.make_step_fn(graphdef, nnx_loss(port, config), noise, port.ema_rate, config.rng_mode)


@dataclasses.dataclass
class LegacySetup:
    """Everything the pmap path needs before its first call."""

    p_train_step: Callable  # jax.pmap(partial(lax.scan, step)), called ((keys_D, pstate), batch_DxK)
    pstate: Any  # replicated train state, leading axis D
    config: RunConfig
    groups: Callable = convert.legacy_groups  # one replica of the state -> {group: tree}
    context: Callable = contextlib.nullcontext  # entered around each call (a loop port's Dropout bridge)

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
        return legacy.unreplicate_to_host(loss_DxK)

    def neutral(self) -> convert.Neutral:
        return convert.groups_to_neutral(self.groups(legacy.unreplicate_to_host(self.pstate)))


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
    config: RunConfig
    decisions: list = dataclasses.field(default_factory=list)  # sharding.Decision per parameter

    @property
    def model(self):
        return nnx.merge(self.graphdef, self.state).model

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        rng, (keys, batch) = placed_inputs(self, rng, batch_KxG)
        return rng, ((keys, self.state), batch)

    def call(self, args: tuple) -> np.ndarray:
        (_, self.state), loss_K = self.fused(*args)
        return np.asarray(loss_K)

    def neutral(self) -> convert.Neutral:
        return convert.nnx_to_neutral(self.graphdef, gather.to_host(self.state))

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
    config: RunConfig
    decisions: list = dataclasses.field(default_factory=list)

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        return placed_inputs(self, rng, batch_KxG)

    def call(self, args: tuple) -> np.ndarray:
        _, loss_K = self.fused(self.ts, *args)
        return np.asarray(loss_K)

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
class NnxLoopSetup:
    """A loop port's NNX side: the user's fused call over the user's train state."""

    port: LoopPort
    train_state: Any  # whatever port.new_state returned, placed on the mesh
    mesh: Any
    config: RunConfig

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        return placed_inputs(self, rng, batch_KxG)

    def call(self, args: tuple) -> np.ndarray:
        with randomness.bridged(self.config.rng_mode):
            self.train_state, losses_K = self.port.new_call(self.train_state, *args)
        return np.asarray(losses_K)

    def neutral(self) -> convert.Neutral:
        groups = self.port.new_groups or new_side.read_groups
        return convert.groups_to_neutral(gather.to_host(groups(self.train_state)))

    def view(self) -> nnx.Module:
        """The team's train state, viewed under ``nnx_sharded.train.TrainState``'s names (``View``); with
        ``new_groups=`` its own layout (``checkpoint.layout.group_places`` maps into it)."""
        return self.train_state if self.port.new_groups is not None else View.of(self.train_state)

    def restored(self, train_state: nnx.Module) -> None:
        """Loaded in place (the view shares the team's objects): nothing to take back."""

    def as_pure_call(self) -> tuple[Callable, Any]:
        """``(jax.jit(call over split state), typed state)``: the user's call as one program whose
        inputs are arrays, so that explain can lower it and name every input. A pytree train state
        (``new_side``) is such an input as it is."""
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


def nnx_mesh(config: RunConfig):
    return sharding.make_mesh(config.devices, sharding.mesh_shape(config.strategy, config.devices, config.mesh_axes))


def twin_placed_inputs(setup, rng, batch_KxG) -> tuple[jax.Array, tuple]:
    """The checked run's keys (``config.devices`` rows in per-device mode), replicated on the twin's
    mesh, whose size may not divide them; the batch split over the twin's data axis as usual."""
    rng, keys = sharded.next_call_keys(rng, setup.config.devices, setup.config.rng_mode)
    return rng, (sharding.put(keys, sharding.replicated(setup.mesh)), sharding.place_batch(batch_KxG, setup.mesh))


def model_holding(port: Port, variables: dict) -> nnx.Module:
    """The port's NNX model holding linen's variables. Built abstractly first (``nnx.eval_shape``: no
    initializer runs, so none is compiled, about a second of a fresh process's check) and filled with
    linen's arrays. A model that holds what linen does not give (a Dropout's random stream, an array
    of its own), or that cannot be built abstractly, is built for real, as before."""
    mapping = check_names(port, variables)
    try:
        if not model_facts(port).own_state:  # else an abstract model is built only to be thrown away
            model = nnx.eval_shape(lambda: port.nnx_model(nnx.Rngs(0)))
            convert.load_linen_variables(model, variables, mapping)
            if not any(_abstract(value) for _, value in nnx.iter_graph(model)):
                return model
    except Exception:  # noqa: BLE001 -- built for real below, where the port's own error is raised
        pass
    model = port.nnx_model(nnx.Rngs(0))
    convert.load_linen_variables(model, variables, mapping)
    return model


def _abstract(value) -> bool:
    if isinstance(value, nnx.Variable):
        value = value.get_value()
    return isinstance(value, jax.ShapeDtypeStruct | jax.core.Tracer)


class View(nnx.Module):
    """A loop port's NNX objects under the names of ``nnx_sharded.train.TrainState`` (``model``,
    ``optimizer``, ``ema``), so that one checkpoint layout serves both levels. The view shares them:
    restoring into the view restores into the team's own model and optimizer."""

    def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer, ema: nnx.Module | None = None):
        self.model, self.optimizer, self.ema = model, optimizer, ema

    @classmethod
    def of(cls, train_state: Any) -> 'View':
        return cls(*convert.find_nnx_objects(train_state))
