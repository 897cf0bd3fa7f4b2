"""Runs both implementations from the same seed and data, and compares what they end with.

One seed fixes everything: the data (numpy), the linen initialisation (copied into NNX,
since the two initialisers differ) and the host key chain both paths draw call keys from.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from equivalence.core import compare, convert
from equivalence.core.config import RunConfig
from equivalence.core.workloads import Workload
from legacy_pmap import train as legacy
from nnx_sharded import sharding
from nnx_sharded import train as sharded


@dataclasses.dataclass
class PathResult:
    final: convert.Neutral  # state after the last call
    losses: np.ndarray  # [C * K] per-step losses, as each path reports them
    params_per_call: list[dict[str, np.ndarray]]  # parameters after each call
    raw: Any  # the path's own final state (legacy: replicated, nnx: (graphdef, state))
    eval_accuracy: float | None = None  # held-out accuracy, for classifiers


@dataclasses.dataclass
class RunResult:
    config: RunConfig
    legacy: PathResult
    nnx: PathResult
    report: compare.Report

    def param_divergence(self) -> list[float]:
        """Max |nnx - legacy| over all parameters, after each call."""
        pairs = zip(self.legacy.params_per_call, self.nnx.params_per_call, strict=True)
        return [max(float(np.abs(a[k] - b[k]).max()) for k in a) for a, b in pairs]


def make_inputs(wl: Workload, config: RunConfig) -> tuple[dict, list[dict], jax.Array]:
    """Linen variables, the data of each call ``[K, G, ...]``, and the training key."""
    data = wl.make_data(np.random.default_rng(config.seed), config.steps, config.batch_size)
    calls = [
        {k: v[c * config.steps_per_call : (c + 1) * config.steps_per_call] for k, v in data.items()}
        for c in range(config.calls)
    ]
    rng, init_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    example = {k: v[0, :1] for k, v in data.items()}
    variables = wl.legacy_model().init(init_rng, *wl.init_args(example))
    return variables, calls, rng


@dataclasses.dataclass
class LegacySetup:
    """Everything the pmap path needs before its first call."""

    p_train_step: Callable  # jax.pmap(partial(lax.scan, step)), called ((keys_D, pstate), batch_DxK)
    pstate: Any  # replicated TrainState, leading axis D
    config: RunConfig

    def call_args(self, rng, batch_KxG: dict) -> tuple[jax.Array, tuple]:
        """``(next rng, args of one call)`` in score_sde's layout."""
        n = self.config.devices
        rng, keys_D = legacy.next_call_keys(rng, n, self.config.rng_mode)
        batch_DxK = {k: legacy.shard_batch(v, n) for k, v in batch_KxG.items()}
        return rng, ((keys_D, self.pstate), batch_DxK)


@dataclasses.dataclass
class NnxSetup:
    """Everything the sharded path needs before its first call."""

    fused: Callable  # jax.jit(train.scan_steps(step)), called ((keys, state), batch_KxG) -> (carry, loss_K)
    graphdef: Any
    state: Any  # the TrainState's arrays, a plain dict (nnx.to_pure_dict), placed on the mesh
    mesh: Any
    config: RunConfig

    def call_args(self, rng, batch_KxG: dict) -> tuple[jax.Array, tuple]:
        mode = self.config.rng_mode
        rng, keys = sharded.next_call_keys(rng, self.config.devices, mode)
        carry = (sharding.place_keys(keys, self.mesh, mode), self.state)
        return rng, (carry, sharding.place_batch(batch_KxG, self.mesh))


def legacy_setup(wl: Workload, config: RunConfig, variables: dict) -> LegacySetup:
    devices = jax.devices()[: config.devices]
    tx = wl.make_tx(1.0)
    pstate = legacy.replicate(legacy.create_state(variables, tx, wl.ema_rate), devices)
    step = legacy.make_step_fn(wl.legacy_model(), wl.legacy_loss, wl.legacy_noise, tx, wl.ema_rate, config.rng_mode)
    return LegacySetup(legacy.make_fused_call(step, devices), pstate, config)


def nnx_setup(wl: Workload, config: RunConfig, variables: dict) -> NnxSetup:
    mesh = sharding.make_mesh(config.devices)
    model = wl.nnx_model(nnx.Rngs(0))
    convert.load_linen_variables(model, variables)
    graphdef, state = sharded.create_state(model, wl.make_tx(1.0 + config.perturb), wl.ema_rate)
    state = sharding.place_state(state, mesh)
    step = sharded.make_step_fn(graphdef, wl.nnx_loss, wl.nnx_noise, wl.ema_rate, config.rng_mode)
    carry_shardings = (sharding.key_sharding(mesh, config.rng_mode), sharding.state_shardings(state, mesh))
    return NnxSetup(sharded.make_fused_call(step, carry_shardings), graphdef, state, mesh, config)


Progress = Callable[[str], None]  # called with 'legacy' or 'nnx' after each compiled call


def _silent(path: str) -> None:
    pass


def run_legacy(
    wl: Workload, config: RunConfig, variables: dict, calls: list[dict], rng, progress=_silent
) -> PathResult:
    setup = legacy_setup(wl, config, variables)
    losses, per_call = [], []
    for batch_KxG in calls:
        rng, args = setup.call_args(rng, batch_KxG)
        (_, setup.pstate), loss_DxK = setup.p_train_step(*args)
        losses.append(np.asarray(legacy.unreplicate(loss_DxK)))  # blocks: one call in flight
        per_call.append(convert.flatten(legacy.unreplicate(setup.pstate.params)))
        progress('legacy')
    state = legacy.unreplicate(setup.pstate)
    result = PathResult(convert.legacy_to_neutral(state), np.concatenate(losses), per_call, setup.pstate)
    if wl.eval_data is not None:
        data = wl.eval_data()
        logits = wl.legacy_predict(wl.legacy_model(), state.params, state.model_state, data['x'])
        result.eval_accuracy = accuracy(logits, data['y'])
    return result


def run_nnx(wl: Workload, config: RunConfig, variables: dict, calls: list[dict], rng, progress=_silent) -> PathResult:
    setup = nnx_setup(wl, config, variables)
    losses, per_call = [], []
    for batch_KxG in calls:
        rng, args = setup.call_args(rng, batch_KxG)
        (_, setup.state), loss_K = setup.fused(*args)
        losses.append(np.asarray(loss_K))  # blocks: one call in flight
        model = nnx.merge(setup.graphdef, setup.state).model
        per_call.append(convert.flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
        progress('nnx')
    final = convert.nnx_to_neutral(setup.graphdef, setup.state)
    result = PathResult(final, np.concatenate(losses), per_call, (setup.graphdef, setup.state))
    if wl.eval_data is not None:
        data = wl.eval_data()
        logits = wl.nnx_predict(nnx.merge(setup.graphdef, setup.state).model, data['x'])
        result.eval_accuracy = accuracy(logits, data['y'])
    return result


def accuracy(logits_BxC, labels_B: np.ndarray) -> float:
    return float(np.mean(np.argmax(np.asarray(logits_BxC), axis=-1) == labels_B))


def replica_spread(replicated: Any) -> float:
    """Max |replica d - replica 0| over every leaf of a pmap-replicated tree; 0.0 when in sync."""
    spreads = [
        np.abs(np.asarray(x, np.float64) - np.asarray(x, np.float64)[:1]).max() for x in jax.tree.leaves(replicated)
    ]
    return float(max(spreads, default=0.0))


def with_losses(neutral: convert.Neutral, losses: np.ndarray) -> convert.Neutral:
    return {**neutral, 'losses': {'per_step': losses}}


def run(wl: Workload, config: RunConfig, progress: Progress | None = None) -> RunResult:
    """Both paths, then the comparison of parameters, optimizer state, EMA, stats, losses.

    ``progress``, if given, is called after each of the 2 * C compiled calls.
    """
    variables, calls, rng = make_inputs(wl, config)
    old = run_legacy(wl, config, variables, calls, rng, progress or _silent)
    new = run_nnx(wl, config, variables, calls, rng, progress or _silent)
    report = compare.compare(with_losses(old.final, old.losses), with_losses(new.final, new.losses), wl.tolerance)
    return RunResult(config, old, new, report)
