"""The training calls the benchmark times, each with its own state, inputs and key chain.

Every variant starts from the same linen variables, the same data pool and the same host
key chain, so the first call of each computes the same losses (the bench checks this).
After that each threads its own state from call to call: the NNX variants donate the
state, the legacy pmap donates the batch (as score_sde), so no input is ever used twice.

Inputs are placed on the devices by ``place`` *before* the timer starts: the timed region
is the call and the wait for its result, for every variant alike.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equivalence.core.port.config import RunConfig
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import LoopPort
from equivalence.core.port.ports import ModelPort as Workload
from equivalence.core.port.workloads import WORKLOADS
from equivalence.core.rng import randomness
from equivalence.core.run import setups
from equivalence.core.run.inputs import Inputs
from equivalence.distributed import rows
from legacy_pmap import train as legacy
from nnx_sharded import sharding
from nnx_sharded import train as sharded


@dataclasses.dataclass
class Variant:
    name: str  # key in the JSON report
    label: str  # row of the printed table
    steps_per_call: int  # K
    place: Callable[[int], list[tuple]]  # n -> the placed arguments of the next n calls
    call: Callable[[tuple], jax.Array]  # one call; keeps the new state, returns its losses (to block on)
    fresh_lowered: Callable[[int], Any]  # K -> a jax Lowered of a fresh build (compile timing)
    host_losses: Callable[[jax.Array], np.ndarray] = np.asarray  # what ``call`` returned -> [K] on the host
    facts: dict = dataclasses.field(default_factory=dict)  # a loop port's call: what its first call showed


class Feed:
    """The data pool and a host key chain: what call c of a K-step variant consumes.

    Call c takes steps ``c*K .. c*K+K-1`` of the pool (cycling), so the first call of every
    variant sees the same first steps whatever its K.
    """

    def __init__(self, kind: Kind, inputs: Inputs, config: Run, pool_steps: int):
        """``kind`` and ``inputs``: the harness's preparation (``harness.prepare``: the linen variables, the
        names paired once, the key chain); ``kind`` builds each side's setups."""
        data = kind.port.make_data(np.random.default_rng(config.seed), pool_steps, config.batch_size)
        self.data, self.pool_steps, self.devices = data, pool_steps, config.devices
        self.kind, self.inputs = kind, inputs
        self.variables, self.rng = inputs.variables, inputs.rng

    def batches(self, k: int, n: int, start: int) -> list[dict[str, np.ndarray]]:
        """``n`` batches ``[K, G, ...]`` from call ``start`` on, on the host: each variant hands JAX
        only the rows its placement gives this process (``rows``), before the timer starts."""
        idx = [np.arange(c * k, c * k + k) % self.pool_steps for c in range(start, start + n)]
        return [jax.tree.map(lambda v, i=i: v[i], self.data) for i in idx]


class _Chain:
    """One variant's position in the host key chain and in the data pool."""

    def __init__(self, feed: Feed, k: int, next_keys: Callable):
        self.feed, self.k, self.next_keys = feed, k, next_keys
        self.rng, self.calls = feed.rng, 0

    def take(self, n: int) -> list[tuple[jax.Array, dict]]:
        """Keys and host batches of the next ``n`` calls."""
        out = []
        for batch_KxG in self.feed.batches(self.k, n, self.calls):
            self.rng, keys = self.next_keys(self.rng)
            out.append((keys, batch_KxG))
        self.calls += n
        return out


def _config(config: Run, k: int) -> Run:
    return dataclasses.replace(config, steps_per_call=k, calls=1)


def legacy_variant(wl: Workload, config: Run, feed: Feed, k: int, name: str, label: str) -> Variant:
    """``jax.pmap(partial(lax.scan, step))``: inputs placed as pmap's own outputs are, one row per
    device (of this process: with several, each passes its own devices' rows)."""
    cfg = _config(config, k)
    setup = feed.kind.legacy_setup(cfg, feed.inputs)
    devices = rows.local_devices(cfg.devices)
    per_device = NamedSharding(Mesh(np.array(devices), (legacy.AXIS,)), P(legacy.AXIS))
    chain = _Chain(feed, k, lambda rng: legacy.next_call_keys(rng, cfg.devices, cfg.rng_mode))

    def to_device(keys, batch_KxG):
        batch_KxR = rows.local_batch(batch_KxG, cfg.devices)
        batch_nxK = jax.tree.map(lambda v: legacy.shard_batch(v, len(devices)), batch_KxR)
        return jax.device_put((rows.local_keys(keys, cfg.devices), batch_nxK), per_device)

    def place(n: int) -> list[tuple]:
        return jax.block_until_ready([to_device(*a) for a in chain.take(n)])

    def call(args: tuple) -> jax.Array:
        keys_D, batch_DxK = args
        with setup.context():  # a loop port's Dropout bridge, for the first (tracing) call
            (_, setup.pstate), loss_DxK = setup.p_train_step((keys_D, setup.pstate), batch_DxK)
        return loss_DxK

    def fresh_lowered(kk: int):
        fresh = feed.kind.legacy_setup(_config(config, kk), feed.inputs)
        keys_D, batch_DxK = to_device(*_Chain(feed, kk, chain.next_keys).take(1)[0])
        with fresh.context():
            return fresh.p_train_step.lower((keys_D, fresh.pstate), batch_DxK)

    def to_host(loss_DxK: jax.Array) -> np.ndarray:
        return legacy.unreplicate_to_host(loss_DxK)  # replica 0's shard: no compiled gather

    return Variant(name, label, k, place, call, fresh_lowered, to_host)


def _nnx_place(setup: setups.NnxSetup, chain: _Chain) -> Callable[[int], list[tuple]]:
    def place(n: int) -> list[tuple]:
        mode, mesh, cfg = setup.config.rng_mode, setup.mesh, setup.config
        held = rows.held_rows(sharding.batch_sharding(mesh), cfg.batch_size)
        placed = [
            (sharding.place_keys(k, mesh, mode), sharding.place_batch(rows.local_batch(b, cfg.devices, held), mesh))
            for k, b in chain.take(n)
        ]
        return jax.block_until_ready(placed)

    return place


def _nnx_chain(feed: Feed, setup: setups.NnxSetup, k: int) -> _Chain:
    cfg = setup.config
    return _Chain(feed, k, lambda rng: sharded.next_call_keys(rng, cfg.devices, cfg.rng_mode))


def bare_jit(setup: setups.NnxSetup, wl: Workload) -> Callable:
    """The baseline of the host-overhead target: ``jax.jit`` of the same scan, no ``out_shardings``."""
    cfg = setup.config
    step = setups.nnx_step(wl, setup.graphdef, cfg)
    return jax.jit(sharded.scan_steps(step), donate_argnums=0)


def partitioner_all_reduce(fn: Callable) -> Callable:
    """``fn`` traced with the plain gradient: the partitioner all-reduces each kernel gradient
    before its transpose (``sharding.partitioner_places_all_reduce``), as before fix 4."""

    def traced(*args):
        with sharding.partitioner_places_all_reduce():
            return fn(*args)

    return traced


def transposed_jit(setup: setups.NnxSetup, wl: Workload) -> Callable:
    """The shipped call but for where the gradient's all-reduce runs: before the kernel transposes."""
    step = setups.nnx_step(wl, setup.graphdef, setup.config)
    carry = (
        sharding.key_sharding(setup.mesh, setup.config.rng_mode),
        sharding.state_shardings(setup.graphdef, setup.state, setup.mesh),
    )
    return jax.jit(partitioner_all_reduce(sharded.scan_steps(step)), donate_argnums=0, out_shardings=(carry, None))


def first_shipped_jit(setup: setups.NnxSetup, wl: Workload) -> Callable:
    """The shipped call as it was first written, to measure what fixes 2 to 4 gained: the
    scan carried the ``nnx.State`` that ``nnx.split`` returns (flattened in Python on every
    call), each step returned its mean loss (one more all-reduce operand per step) and the
    gradient was all-reduced before the kernel transposes."""
    cfg = setup.config
    step = setups.nnx_step(wl, setup.graphdef, cfg)

    def step_state(carry, batch):
        (rng, pure), losses_G = step(carry, batch)
        return (rng, nnx.state(nnx.merge(setup.graphdef, pure))), jnp.mean(losses_G)

    state_shardings = nnx.state(
        nnx.merge(setup.graphdef, sharding.state_shardings(setup.graphdef, setup.state, setup.mesh))
    )
    setup.state = nnx.state(nnx.merge(setup.graphdef, setup.state))  # the same placed arrays, as an nnx.State
    shardings = (sharding.key_sharding(setup.mesh, cfg.rng_mode), state_shardings)
    scan = partitioner_all_reduce(functools.partial(jax.lax.scan, step_state))
    return jax.jit(scan, donate_argnums=0, out_shardings=(shardings, None))


JITS = {'shipped': lambda setup, wl: setup.fused, 'bare': bare_jit, 'first': first_shipped_jit}
JITS |= {'transposed': transposed_jit}


def nnx_variant(wl: Workload, config: Run, feed: Feed, k: int, name: str, label: str, jit: str = 'shipped'):
    """The shipped call (the kind's ``new_setup``), or the same step under another ``jax.jit`` (see ``JITS``)."""

    def build(kk: int) -> tuple[setups.NnxSetup, Callable]:
        setup = feed.kind.new_setup(_config(config, kk), feed.inputs)
        return setup, JITS[jit](setup, wl)

    setup, fused = build(k)
    place = _nnx_place(setup, _nnx_chain(feed, setup, k))

    def call(args: tuple) -> jax.Array:
        keys, batch_KxG = args
        (_, setup.state), loss_K = fused((keys, setup.state), batch_KxG)
        return loss_K

    def fresh_lowered(kk: int):
        fresh, fn = build(kk)
        keys, batch_KxG = _nnx_place(fresh, _nnx_chain(feed, fresh, kk))(1)[0]
        return fn.lower((keys, fresh.state), batch_KxG)

    return Variant(name, label, k, place, call, fresh_lowered)


def graph_variant(wl: Workload, config: Run, feed: Feed, k: int, name: str, label: str, cached: bool = False):
    """``--nnx-form graph``: ``train.make_graph_call``'s ``nnx.jit(nnx.scan)`` over the TrainState
    object, called with the object; with ``cached``, through ``nnx.cached_partial``."""

    def build(kk: int) -> setups.NnxGraphSetup:
        return feed.kind.new_setup(dataclasses.replace(_config(config, kk), nnx_form='graph'), feed.inputs)

    setup = build(k)
    place = _nnx_place(setup, _nnx_chain(feed, setup, k))
    run = nnx.cached_partial(setup.fused, setup.ts) if cached else functools.partial(setup.fused, setup.ts)

    def fresh_lowered(kk: int):
        fresh = build(kk)
        keys, batch_KxG = _nnx_place(fresh, _nnx_chain(feed, fresh, kk))(1)[0]
        return fresh.fused.lower(fresh.ts, keys, batch_KxG)  # cached_partial calls this same nnx.jit

    return Variant(name, label, k, place, lambda args: run(*args)[1], fresh_lowered)


def strategy_variants(wl: Workload, feed: Feed, configs: list[RunConfig]) -> list[Variant]:
    """The shipped call at K under each config's strategy, in its form."""
    out = []
    for cfg in configs:
        form = '_graph' if cfg.nnx_form == 'graph' else ''
        label = f'nnx {cfg.strategy}' + (', graph form' if form else '')
        make = graph_variant if form else nnx_variant
        out.append(make(wl, cfg, feed, cfg.steps_per_call, f'nnx_{cfg.strategy}{form}', label))
    return out


def loop_variant(port: LoopPort, config: Run, feed: Feed, k: int, name: str, label: str) -> Variant:
    """A loop port's own NNX call over its own train state."""
    setup = feed.kind.new_setup(_config(config, k), feed.inputs)
    place = _nnx_place(setup, _nnx_chain(feed, setup, k))
    facts = {'state_kind': state_kind(setup.train_state)}

    def call(args: tuple) -> jax.Array:
        before = None if 'state_arrays' in facts else state_arrays(setup.train_state)
        with randomness.bridged(setup.config.rng_mode):
            setup.train_state, losses_K = port.new_call(setup.train_state, *args)
        if before is not None:  # the first call: donated input buffers are deleted by it
            facts.update(state_arrays=len(before), donated_arrays=sum(a.is_deleted() for a in before))
        return losses_K

    def fresh_lowered(kk: int):
        fresh = feed.kind.new_setup(_config(config, kk), feed.inputs)
        fn, state = fresh.as_pure_call()
        return fn.lower(state, *_nnx_place(fresh, _nnx_chain(feed, fresh, kk))(1)[0])

    return Variant(name, label, k, place, call, fresh_lowered, facts=facts)


def state_kind(train_state: Any) -> str:
    """'objects' (NNX graph nodes: a call walks them), 'nnx.State' (a Python pytree) or 'pytree'."""
    leaves = jax.tree.leaves(train_state, is_leaf=lambda x: isinstance(x, nnx.Pytree | nnx.State))
    if any(isinstance(x, nnx.Pytree) and not isinstance(x, nnx.State) for x in leaves):
        return 'objects'
    return 'nnx.State' if any(isinstance(x, nnx.State) for x in leaves) else 'pytree'


def state_arrays(train_state: Any) -> list[jax.Array]:
    tree = nnx.state(train_state) if state_kind(train_state) == 'objects' else train_state
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def build_loop(port: LoopPort, config: Run, feed: Feed, k_scaling: int) -> list[Variant]:
    """A loop port: its pmap step and its NNX call, fused at K, one step per call, and at ``k_scaling``."""
    ks = sorted({config.steps_per_call, 1, k_scaling}, key=lambda k: (k != config.steps_per_call, k))
    variants = []
    for k in ks:
        suffix, text = ('', '') if k == config.steps_per_call else (f'_k{k}', f', K={k}')
        variants.append(legacy_variant(port, config, feed, k, f'legacy{suffix}', f'legacy pmap(scan){text}'))
        variants.append(loop_variant(port, config, feed, k, f'nnx{suffix}', f"the port's NNX call{text}"))
    return variants


SUITES_OWN = ('jit_bare', 'nnx_first', 'nnx_transposed', 'nnx_cached')  # the suite's own history and probes


def build_model(wl: Workload, config: Run, feed: Feed, k_scaling: int, strategy_configs=()) -> list[Variant]:
    """A model port: the fused variants at K, then one step per call, then both paths at ``k_scaling``, then
    the shipped call under each of ``strategy_configs`` (the default variants are data parallel). The
    suite's own variants (``SUITES_OWN``: its NNX call as first shipped, bare and reordered jits, the
    cached graph form), which measure the suite's history, are timed for the built-in workloads only:
    a team's model port gets the two sides, the graph form it may write, and K = 1 and ``k_scaling``."""
    extra = strategy_variants(wl, feed, list(strategy_configs))
    k, own = config.steps_per_call, WORKLOADS.get(config.workload) is wl
    variants = [
        legacy_variant(wl, config, feed, k, 'legacy', 'legacy pmap(scan)'),
        nnx_variant(wl, config, feed, k, 'nnx', 'nnx shipped: jax.jit(scan), split state'),
        *(
            [
                nnx_variant(wl, config, feed, k, 'jit_bare', 'bare jax.jit(scan), no out_shardings', jit='bare'),
                nnx_variant(wl, config, feed, k, 'nnx_first', 'nnx as first shipped (before the fixes)', jit='first'),
                nnx_variant(wl, config, feed, k, 'nnx_transposed', 'nnx, all-reduce before transposes', 'transposed'),
            ]
            if own
            else []
        ),
        graph_variant(wl, config, feed, k, 'nnx_graph', 'nnx.jit(nnx.scan), graph mode'),
        *([graph_variant(wl, config, feed, k, 'nnx_cached', 'nnx.cached_partial(nnx.jit)', cached=True)] * own),
        legacy_variant(wl, config, feed, 1, 'legacy_k1', 'legacy pmap, 1 step/call'),
        nnx_variant(wl, config, feed, 1, 'nnx_k1', 'nnx shipped, 1 step/call'),
    ]
    if k_scaling != k:  # long calls: host time amortised, the device programs compared
        ks = k_scaling
        variants.append(legacy_variant(wl, config, feed, ks, f'legacy_k{ks}', f'legacy pmap, K={ks}'))
        variants.append(nnx_variant(wl, config, feed, ks, f'nnx_k{ks}', f'nnx shipped, K={ks}'))
    return variants + extra
