"""Runs both implementations from the same seed and data, and compares what they end with.

One seed fixes everything: the data (numpy), the linen initialisation (copied into NNX,
since the two initialisers differ) and the host key chain both paths draw call keys from.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from equivalence.core import compare, convert, hints, new_side, randomness, states
from equivalence.core.config import ConfigError, RunConfig
from equivalence.core.ports import LoopPort, Port
from equivalence.core.setups import (  # noqa: F401 -- the setups, part of this module's API
    LegacySetup,
    NnxGraphSetup,
    NnxLoopSetup,
    NnxSetup,
    abstract_model,
    check_names,
    global_calls,
    has_batch_stats,
    input_rows,
    legacy_loss,
    legacy_setup,
    make_inputs,
    nnx_loss,
    nnx_mesh,
    nnx_setup,
    nnx_step,
    placed_inputs,
    port_noise,
    step_adapters,
    uses_dropout,
)
from legacy_pmap import train as legacy


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


@dataclasses.dataclass
class RunResult:
    config: RunConfig
    legacy: PathResult
    nnx: PathResult
    report: compare.Report
    resumed_at: int = 0  # NNX resumed from a checkpoint of this step: losses and divergence cover the steps after it
    notes: list[str] = dataclasses.field(default_factory=list)  # lines the report prints under its header
    verdict: Any = None  # verdict.Verdict: what was measured and, on MISMATCH, the diagnosis (judge)
    programs: tuple[str, str] = ('pmap(scan)', 'sharded scan')  # how each side ran its K steps (header)

    def param_divergence(self) -> list[float]:
        """Max |nnx - legacy| over all parameters, after each call."""
        pairs = zip(self.legacy.params_per_call, self.nnx.params_per_call, strict=True)
        return [max(float(np.abs(a[k] - b[k]).max()) for k in a) for a, b in pairs]


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
        result.notes += states.legacy_not_compared(legacy.unreplicate(setup.pstate))
    if getattr(port, 'eval_data', None) is not None:
        state, data = legacy.unreplicate(setup.pstate), port.eval_data()
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

    lines = [step_adapters().describe(port)] if step_adapters().adapted(port) else []
    lines += [*old.notes, *new.notes, *notes, *randomness.take_unbridged()]
    lines += [f'not compared: metrics/{p}: only the {"pmap" if p in old.metrics else "NNX"} step reports it'
              for p in one_side]  # fmt: skip
    return tree, list(dict.fromkeys(lines))


def validate(port: Port, config: RunConfig) -> None:
    """What a port cannot do with these flags, as ``ConfigError`` (exit 2), before any work."""
    if config.rng_mode not in port.rng_modes:
        raise ConfigError(f'--rng {config.rng_mode}: port {port.name!r} supports {", ".join(port.rng_modes)}')
    if isinstance(port, LoopPort) and (config.strategy, config.nnx_form) != ('dp', 'split'):
        raise ConfigError("--strategy and --nnx-form place the suite's NNX loop; a loop port brings its own")
    if config.strategy == 'shard_map' and has_batch_stats(port):
        raise ConfigError('--strategy shard_map: the model has BatchNorm, whose statistics would be per device here')
    if isinstance(port, LoopPort) and config.perturb:
        raise ConfigError("--perturb scales the suite's NNX optimizer: a loop port brings its own (perturb it there)")
    if isinstance(port, LoopPort):
        step_adapters().check(port)


def run(port: Port, config: RunConfig, progress: Progress | None = None) -> RunResult:
    """Both paths, then the comparison of parameters, optimizer state, EMA, stats, losses.

    The two sides' variable names are paired first: a port whose names do not pair stops
    here, before any training (``naming.PortError``). ``progress``, if given, is called
    after each of the 2 * C compiled calls.
    """
    from equivalence.core import preflight  # it traces what this module builds

    validate(port, config)
    preflight.check(port, config)  # every port traced abstractly: a mistake in it is exit 2, before training
    variables, calls, rng = make_inputs(port, config)
    check_names(port, variables)
    randomness.take_unbridged()  # what earlier runs traced is theirs
    old = run_legacy(port, config, variables, calls, rng, progress or silent)
    new = run_nnx(port, config, variables, calls, rng, progress or silent)
    tree, notes = compared(port, old, new)
    result = judged(port, config, old, new, variables, calls, rng, tree)
    if step_adapters().adapted(port):
        result.programs = step_adapters().programs(port)
    result.notes += notes + hints.masked_loss(
        config.devices, calls[0], result.report, lambda: _matches_on_one(port, config)
    )
    return result


def judged(
    port: Port, config: RunConfig, old: PathResult, new: PathResult, variables, calls, rng, tree=None, **resumed
) -> RunResult:
    """The two runs judged against their measured noise floor (``equivalence.core.judge``);
    ``resumed``: ``restore`` and ``first_call`` of a run NNX resumed from a checkpoint."""
    from equivalence.core import judge  # judge runs the twin through this module

    inputs = judge.Inputs(variables, calls, rng, **resumed)
    report, verdict = judge.judge(port, config, old, new, inputs, tree or compared(port, old, new)[0])
    return RunResult(config, old, new, report, verdict=verdict)


def _matches_on_one(port: Port, config: RunConfig) -> bool:
    """Whether the same run matches on one device (data parallel, one process): the masked-loss hint's test."""
    if jax.process_count() != 1 or config.strategy != 'dp':
        return False
    try:
        return run(port, dataclasses.replace(config, devices=1)).report.match
    except ConfigError:
        return False


def check(port: Port, **flags) -> RunResult:
    """Run both paths of ``port`` on this process's devices and compare them: the library form
    of ``python -m equivalence.run``. ``flags`` are ``RunConfig`` fields (``devices`` defaults
    to every device JAX sees, ``batch_size`` to the port's); bad values raise ``ConfigError``."""
    flags.setdefault('devices', len(jax.devices()))
    flags.setdefault('batch_size', port.default_batch)
    flags.setdefault('rng_mode', port.rng_modes[0])
    config = RunConfig(workload=port.name, available=len(jax.devices()), **flags)
    return run(port, config)
