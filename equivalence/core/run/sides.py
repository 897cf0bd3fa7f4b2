"""Each side set up (``legacy_setup``, ``nnx_setup``) and run call by call from the same seed and
data (``run_legacy``, ``run_nnx``), and what of their results is compared (``compared``).

One seed fixes everything: the data (numpy), the linen initialisation (copied into NNX,
since the two initialisers differ) and the host key chain both paths draw call keys from.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from equivalence.core.port import convert, new_side, states
from equivalence.core.port.config import RunConfig
from equivalence.core.port.ports import LoopPort, ModelPort, Port
from equivalence.core.run import adapters, footprint, randomness
from equivalence.core.run.setups import (
    LegacySetup,
    NnxGraphSetup,
    NnxLoopSetup,
    NnxSetup,
    check_names,
    legacy_loss,
    model_facts,
    nnx_loss,
    nnx_mesh,
    nnx_step,
    port_noise,
    uses_dropout,
)
from equivalence.distributed import rows
from legacy_pmap import train as legacy
from nnx_sharded import shard_map, sharding
from nnx_sharded import train as sharded


@dataclasses.dataclass
class PathResult:
    final: convert.Neutral  # state after the last call
    losses: np.ndarray  # [C * K] per-step losses, as each path reports them
    params_per_call: list[dict[str, np.ndarray]]  # parameters after each call
    raw: Any  # the path's own final state (legacy: replicated, nnx: (graphdef, state))
    eval_accuracy: float | None = None  # held-out accuracy, for classifiers
    placement: list = dataclasses.field(default_factory=list)  # NNX: sharding.Decision per parameter
    mesh: dict = dataclasses.field(default_factory=dict)  # NNX: the mesh's axes
    metrics: dict = dataclasses.field(default_factory=dict)  # a loop port's step metrics: path -> [C * K, ...]
    notes: list = dataclasses.field(default_factory=list)  # what this path could not compare, and why
    left_out: set = dataclasses.field(default_factory=set)  # metric paths not compared (named in notes)
    memory: dict | None = None  # NNX: bytes per device of one call (footprint.per_device); None: not measured


Progress = Callable[[str], None]  # called with 'legacy' or 'nnx' after each compiled call
AfterCall = Callable[[Any, int, jax.Array], None]  # (setup, calls done, host key chain for the next call)


def silent(path: str) -> None:
    pass


def run_calls(setup, calls: list, rng, mapping, progress: Progress, path: str, after_call: AfterCall | None = None):
    """Every call in order, one in flight; the losses and the parameters after each call."""
    losses, per_call = [], []
    for i, batch_KxG in enumerate(calls):
        rng, args = setup.call_args(rng, batch_KxG)
        losses.append(setup.call(args))
        per_call.append(_params(setup.neutral(), mapping))
        progress(path)
        if after_call is not None:  # a checkpoint, as a training loop saves between calls
            after_call(setup, i + 1, rng)
    return np.concatenate(losses), per_call


def _params(neutral: convert.Neutral, mapping: dict[str, str] | None) -> dict[str, np.ndarray]:
    return convert.rename(neutral, mapping)['params'] if mapping else neutral['params']


def run_legacy(port: Port, config: RunConfig, variables: dict, calls: list, rng, progress=silent, after_call=None):
    """The pmap path; its leaves are named as the NNX side names them (``check_names``)."""
    mapping = check_names(port, variables)
    setup = legacy_setup(port, config, variables)
    losses, per_call = run_calls(setup, calls, rng, mapping, progress, 'legacy', after_call)
    result = PathResult(convert.rename(setup.neutral(), mapping), losses, per_call, setup.pstate)
    result.metrics, result.notes = loop_metrics(setup), [*getattr(setup, 'notes', [])]
    result.left_out = set(getattr(setup, 'uneven', ()))
    if isinstance(port, LoopPort):
        result.notes += states.legacy_not_compared(legacy.unreplicate_to_host(setup.pstate))
    if getattr(port, 'eval_data', None) is not None:
        state, data = legacy.unreplicate_to_host(setup.pstate), port.eval_data()
        logits = port.legacy_predict(port.legacy_model(), state.params, state.model_state, data['x'])
        result.eval_accuracy = accuracy(logits, data['y'])
    return result


def run_nnx(
    port: Port, config: RunConfig, variables: dict, calls: list, rng, progress=silent, after_call=None, restore=None
):
    """The sharded path. ``restore(setup) -> rng``, if given, loads a checkpoint into the setup
    and returns its key chain: ``calls`` are then the ones after the checkpoint."""
    setup = nnx_setup(port, config, variables)
    if restore is not None:
        rng = restore(setup)
    losses, per_call = run_calls(setup, calls, rng, None, progress, 'nnx', after_call)
    raw = {NnxSetup: lambda: (setup.graphdef, setup.state), NnxGraphSetup: lambda: setup.ts}
    result = PathResult(setup.neutral(), losses, per_call, raw.get(type(setup), lambda: setup.train_state)())
    result.placement, result.mesh = getattr(setup, 'decisions', []), dict(setup.mesh.shape)
    result.memory = footprint.per_device(setup, calls[0], rng)
    result.metrics = loop_metrics(setup)
    if isinstance(port, LoopPort):
        result.notes = new_side.not_compared(setup.train_state)
    if getattr(port, 'eval_data', None) is not None:
        data = port.eval_data()
        logits = port.nnx_predict(setup.model, data['x'])
        result.eval_accuracy = accuracy(logits, data['y'])
    return result


def loop_metrics(setup) -> dict[str, np.ndarray]:
    """A loop port's metrics over every call: path -> ``[C * K, ...]`` (paths every call reported)."""
    per_call = getattr(setup, 'metrics', [])
    paths = set.intersection(*(set(m) for m in per_call)) if per_call else set()
    return {p: np.concatenate([m[p] for m in per_call]) for p in sorted(paths)}


def accuracy(logits_BxC, labels_B: np.ndarray) -> float:
    return float(np.mean(np.argmax(np.asarray(logits_BxC), axis=-1) == labels_B))


def replica_spread(replicated: Any) -> float:
    """Max |replica d - replica 0| over every leaf of a pmap-replicated tree; 0.0 when in sync."""
    spreads = [
        np.abs(np.asarray(x, np.float64) - np.asarray(x, np.float64)[:1]).max() for x in jax.tree.leaves(replicated)
    ]
    return float(max(spreads, default=0.0))


def with_losses(neutral: convert.Neutral, losses: np.ndarray, metrics: dict | None = None) -> convert.Neutral:
    out = {**neutral, 'losses': {'per_step': losses}}
    return {**out, 'metrics': metrics} if metrics else out


def compared(port: Port, old: PathResult, new: PathResult) -> tuple[Callable[[PathResult], convert.Neutral], list[str]]:
    """How each path's result is compared (losses, the metrics both sides report, the groups both
    states hold), and the lines that say what was left out of it."""
    one_side = sorted(set(old.metrics) ^ set(new.metrics))
    left_out = old.left_out | set(one_side)
    kept = lambda metrics: {p: a for p, a in metrics.items() if p not in left_out}  # noqa: E731
    full = lambda path: with_losses(path.final, path.losses, kept(path.metrics))  # noqa: E731
    # A state read by the suite that holds no step counter (a tuple (params, opt_state)) leaves
    # the counter out, said; groups the port maps itself must map it (else: bookkeeping).
    notes = [] if getattr(port, 'legacy_groups', None) else states.align(full(old), full(new))[2]

    def tree(path: PathResult) -> convert.Neutral:
        return states.without(full(path), 'step') if notes else full(path)

    lines = [adapters.describe(port)] if adapters.adapted(port) else []
    lines += adapters.wrapped_notes(port)
    lines += [*old.notes, *new.notes, *notes, *randomness.take_unbridged()]
    lines += [f'not compared: metrics/{p}: only the {"pmap" if p in old.metrics else "NNX"} step reports it'
              for p in one_side]  # fmt: skip
    return tree, list(dict.fromkeys(lines))


def legacy_setup(port: Port, config: RunConfig, variables: dict) -> LegacySetup:
    """pmap spans the first D devices of every process; each process replicates onto its own."""
    devices, local = jax.devices()[: config.devices], rows.local_devices(config.devices)
    if isinstance(port, LoopPort) and adapters.adapted(port):
        return adapters.legacy_setup(port, config, variables)
    if isinstance(port, LoopPort):
        pstate = legacy.replicate(port.legacy_state(variables), local, port.axis_name)
        call = legacy.make_fused_call(adapters.legacy_step(port), devices, port.axis_name)
        context = functools.partial(randomness.bridged, config.rng_mode, port.axis_name)
        return LegacySetup(call, pstate, config, port.legacy_groups or states.legacy_groups, context)
    tx = port.make_tx(1.0)
    pstate = legacy.replicate(legacy.create_state(variables, tx, port.ema_rate), local)
    noise = port_noise(port, uses_dropout(port))
    step = legacy.make_step_fn(
        port.legacy_model(), legacy_loss(port, config), noise, tx, port.ema_rate, config.rng_mode
    )
    return LegacySetup(legacy.make_fused_call(step, devices), pstate, config)


def new_source(port: LoopPort, variables: dict) -> Any:
    """What a loop port's ``new_state`` takes: its NNX model holding linen's weights, or, for a port
    without an NNX model, linen's variables (``new_side``)."""
    if port.nnx_model is None:
        return variables
    return model_holding(port, variables)


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


def loop_new_side(port: LoopPort, config: RunConfig, variables: dict, mesh, fused=NnxLoopSetup) -> Any:
    """A loop port's new side on ``mesh``, whatever the form of its train state: its setup. ``fused``:
    the setup of a port's own fused call (no step form), the twin's where it places the run's keys."""
    source = new_source(port, variables)
    if adapters.adapted(port):
        return adapters.nnx_setup(port, config, source, mesh)
    return fused(port, sharding.place_objects(port.new_state(source), mesh), mesh, config)


def model_state(port: ModelPort, variables: dict, mesh, lr_scale: float, strategy: str | None = None) -> tuple:
    """``(graphdef, state, its shardings on mesh, placement decisions)`` of a model port's NNX side:
    its model holding linen's variables, placed by ``strategy`` (None: nothing annotated, replicated),
    its optimizer at ``lr_scale`` times the port's learning rate. The state is not placed yet."""
    model = model_holding(port, variables)
    decisions = []
    if strategy is not None:
        decisions = sharding.decide(model, strategy, mesh)
        sharding.annotate(model, decisions)
    graphdef, state = sharded.create_state(model, port.make_tx(lr_scale), port.ema_rate)
    return graphdef, state, sharding.state_shardings(graphdef, state, mesh), decisions


def nnx_setup(port: Port, config: RunConfig, variables: dict) -> NnxSetup | NnxGraphSetup | NnxLoopSetup:
    """The NNX side placed by ``config.strategy`` (``nnx_sharded/sharding.py``), in ``config.nnx_form``.

    The step is the same for every strategy: only the annotations on the parameters change.
    """
    mesh = nnx_mesh(config)
    if isinstance(port, LoopPort):
        return loop_new_side(port, config, variables, mesh)
    graphdef, state, shardings, decisions = model_state(port, variables, mesh, 1.0 + config.perturb, config.strategy)
    state = sharding.place_state(state, shardings)
    if config.nnx_form == 'graph':
        update = sharded.make_update_fn(nnx_loss(port, config), port_noise(port, uses_dropout(port)), port.ema_rate,
                                        config.rng_mode)  # fmt: skip
        ts = nnx.merge(graphdef, state)
        return NnxGraphSetup(sharded.make_graph_call(update), ts, mesh, config, decisions)
    if config.strategy == 'shard_map':
        step = shard_map.make_step_fn(graphdef, nnx_loss(port, config), port_noise(port, uses_dropout(port)),
                                      port.ema_rate, config.rng_mode)  # fmt: skip
        fused = shard_map.make_fused_call(step, mesh, config.rng_mode)
        return NnxSetup(fused, graphdef, state, mesh, config, decisions)
    carry_shardings = (sharding.key_sharding(mesh, config.rng_mode), shardings)
    fused = sharded.make_fused_call(nnx_step(port, graphdef, config), carry_shardings)
    return NnxSetup(fused, graphdef, state, mesh, config, decisions)
