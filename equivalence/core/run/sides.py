"""Each side run call by call from the same seed and data (``run_legacy``, ``run_new``); what of their
results is compared is the verdict's (``verdict.judge.compared``). The setups come from the port's kind
(``core.port.kind.Kind``: ``kind.legacy_setup``, ``kind.new_setup``), which is handed in, never asked of
the port's class here.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from equivalence.core.measure import clock, footprint
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Run
from equivalence.core.record import pruned
from equivalence.core.run.inputs import Inputs
from equivalence.core.state import convert


@dataclasses.dataclass
class PathResult:
    final: convert.Neutral  # state after the last call
    losses: np.ndarray  # [C * K] per-step losses, as each path reports them
    params_per_call: list[dict[str, np.ndarray]]  # parameters after each call
    raw: Any  # legacy: its own final state, replicated, on the host; None for the new side (``final`` holds it)
    eval_accuracy: float | None = None  # held-out accuracy, for classifiers
    placement: list = dataclasses.field(default_factory=list)  # NNX: sharding.Decision per parameter
    mesh: dict = dataclasses.field(default_factory=dict)  # NNX: the mesh's axes
    metrics: dict = dataclasses.field(default_factory=dict)  # a loop port's step metrics: path -> [C * K, ...]
    notes: list = dataclasses.field(default_factory=list)  # what this path could not compare, and why
    left_out: set = dataclasses.field(default_factory=set)  # metric paths not compared (named in notes)
    memory: dict | None = None  # NNX: bytes per device of one call (footprint.per_device); None: not measured
    placed_by: str = ''  # who chose ``placement`` where not the suite's strategy ("the port's own step")
    start: dict | None = None  # legacy: the parameters its train state started from (NNX paths), as its own
    # legacy_state built them (an upstream init that sets a head bias to -6.9); None: not recorded
    device_losses: np.ndarray | None = None  # legacy: the last call's losses on every device, [D, K]
    draws: frozenset | None = None  # a recorded first step's own random draws (``draws.own``); None: not recorded
    program: Any = dataclasses.field(default=None, repr=False)  # NNX: its compiled call (``setup.shared()``), which
    # the twins of the run's own program run again (``nudge``)

    def after(self, step: int, k: int) -> 'PathResult':
        """This run's losses, metrics and parameters after ``step`` (a new side resumed there is compared
        with these), its final state as it is."""
        cut = {p: a[step:] for p, a in self.metrics.items()}
        per_call = self.params_per_call[step // k :]
        return dataclasses.replace(self, losses=self.losses[step:], params_per_call=per_call, metrics=cut)


Progress = Callable[[str], None]  # called with 'legacy' or 'new' after each compiled call
AfterCall = Callable[[Any, int, jax.Array], None]  # (setup, calls done, host key chain for the next call)


def silent(path: str) -> None:
    pass


def run_calls(setup, calls: list, rng, mapping, progress: Progress, path: str, after_call: AfterCall | None = None,
              before_call: Callable[[], None] | None = None, forward: bool = False):  # fmt: skip
    """Every call in order, one in flight; the losses and the parameters after each call. ``before_call``:
    told before the first call, once the setup is built (the recording keeps nothing from building it).
    ``forward``: each call's losses and effects alone (``setup.forward``: the recording's forward pass),
    the state as it was."""
    losses, per_call = [], []
    if before_call is not None:
        before_call()
    for i, batch_KxG in enumerate(calls):
        rng, args = setup.call_args(rng, batch_KxG)
        losses.append(setup.forward(args) if forward else setup.call(args))
        per_call.append(_params(setup.neutral(), mapping))
        progress(path)
        if after_call is not None:  # a checkpoint, as a training loop saves between calls
            after_call(setup, i + 1, rng)
    return np.concatenate(losses), per_call


def _params(neutral: convert.Neutral, mapping: dict[str, str] | None) -> dict[str, np.ndarray]:
    return convert.rename(neutral, mapping)['params'] if mapping else neutral['params']


def prefetch(setup, inputs: Inputs, forward: bool = False) -> clock.OnThread | None:
    """The programs of ``setup``'s first call compiled on a thread of their own, from now on, where the setup
    can trace them without running them (``lowered``: the pmap side, the suite's own NNX program), so that
    they compile while the other side runs; its first call then finds them in JAX's cache. None where it
    cannot (the team's own new call, whose programs only its first call compiles; a restored key chain).
    ``forward``: the program of its first ``forward`` call (the pmap side's alone). Never raises: a call
    whose programs are not ready compiles them itself, as it always did."""
    lower = getattr(setup, 'lowered', None)
    if lower is None or inputs.rng is None:
        return None
    try:
        args = setup.call_args(inputs.rng, inputs.calls[0])[1]
        programs = _forward_lowered(setup, args) if forward else lower(args)
    except Exception:  # noqa: BLE001 -- the first call traces again and raises its own error
        return None
    return clock.on_thread(lambda: [p.compile() for p in programs])


def _forward_lowered(setup, args: tuple) -> list:
    """The pmap side's ``forward`` program of the call of ``args``, traced (in its context) and kept for that call
    (``setup.ready``), not compiled."""
    with setup.context():  # lowered in it too: its jit context is a key of JAX's cache, which the call then reads
        setup.ready = pruned.prepare(pruned.traceable(setup.p_train_step), args, pruned.LOSSES)
        return [setup.ready.lower(args)]


def run_legacy(kind: Kind, config: Run, inputs: Inputs, progress=silent, after_call=None,
               before_call=None, setup=None, forward: bool = False) -> PathResult:  # fmt: skip
    """The pmap path; its leaves are named as the NNX side names them (``inputs.mapping``). ``setup``: built
    already (``prefetch``), else here. ``forward``: ``run_calls``'."""
    mapping = inputs.mapping
    setup = setup or kind.legacy_setup(config, inputs)
    start = _params(setup.neutral(), mapping)  # before the first call: what the port's own state holds
    losses, per_call = run_calls(setup, inputs.calls, inputs.rng, mapping, progress, 'legacy', after_call, before_call,
                                 forward)  # fmt: skip
    result = PathResult(convert.rename(setup.neutral(), mapping), losses, per_call, jax.device_get(setup.pstate),
                        start=start, device_losses=getattr(setup, 'device_losses', None))  # fmt: skip
    result.metrics, result.notes = loop_metrics(setup), [*getattr(setup, 'notes', [])]
    result.left_out = set(getattr(setup, 'uneven', ()))
    result.notes += kind.legacy_notes(setup)
    result.eval_accuracy = kind.legacy_accuracy(setup)
    return result


def run_new(kind: Kind, config: Run, inputs: Inputs, progress=silent, after_call=None,
            before_call=None, setup=None, forward: bool = False) -> PathResult:  # fmt: skip
    """The sharded path. With ``inputs.restore(setup) -> rng`` (``--resume-at``) a checkpoint is loaded
    into the setup, which returns its key chain: ``inputs.calls`` are then the ones after the checkpoint.
    ``setup``: built already (``prefetch``), else here. ``forward``: ``run_calls``' (no bytes measured: that
    would compile the whole call)."""
    calls, rng = inputs.calls, inputs.rng
    setup = setup or kind.new_setup(config, inputs)
    if inputs.restore is not None:
        rng = inputs.restore(setup)
    losses, per_call = run_calls(setup, calls, rng, None, progress, 'new', after_call, before_call, forward)
    # its final state leaves the device with the setup (read to the host: ``final``), before any twin of it runs
    result = PathResult(setup.neutral(), losses, per_call, None)
    result.placement, result.mesh = getattr(setup, 'decisions', []), dict(setup.mesh.shape)
    result.placed_by, result.program = getattr(setup, 'placed_by', ''), setup.shared()
    result.memory = None if forward else footprint.per_device(setup, calls[0], rng)
    result.metrics = loop_metrics(setup)
    result.notes = [*getattr(setup, 'notes', []), *kind.new_notes(setup)]
    result.eval_accuracy = kind.new_accuracy(setup)
    return result


def both_sides(kind: Kind, config: Run, inputs: Inputs, progress: Progress = silent) -> tuple:
    """``(legacy, new)`` ``PathResult``s, each program compiled once, while the other side works (``prefetch``):
    the pmap side's program compiles on a thread while the new side's are traced, compiled and run (a
    team's own new call compiles its programs as it runs), or, where the new side's program is the suite's
    own, both compile on threads at once; then each side runs its calls. Each side computes what it would
    alone: the same programs, from the same inputs. Where a side raises, no compile is left running."""
    (legacy_program, new_program), c = kind.programs(), len(inputs.calls)
    compiling: list[clock.OnThread | None] = [None, None]
    try:
        with clock.stage(f'legacy side: {legacy_program} built and traced, compiled on a thread'):
            legacy_setup = kind.legacy_setup(config, inputs)
            compiling[0] = prefetch(legacy_setup, inputs)
        new_setup = new = None
        build_ahead = kind.new_ahead()  # the suite's own program: it compiles on a thread too
        if build_ahead is not None:
            with clock.stage(f'new side: {new_program} built and traced, compiled on a thread'):
                new_setup = build_ahead(config, inputs)
                compiling[1] = prefetch(new_setup, inputs)
        if compiling[1] is None:  # the team's own call: compiled as it runs, while the pmap side compiles
            with clock.stage(f'new side: {new_program}, {c} calls (compiled, run)'):
                new = run_new(kind, config, inputs, progress, setup=new_setup)
        with clock.stage(f'legacy side: {legacy_program}, {c} calls (run)'):
            _wait(compiling[0])
            old = run_legacy(kind, config, inputs, progress, setup=legacy_setup)
        if new is None:
            with clock.stage(f'new side: {new_program}, {c} calls (run)'):
                _wait(compiling[1])
                new = run_new(kind, config, inputs, progress, setup=new_setup)
    except Exception:
        for pending in compiling:
            _wait(pending)
        raise
    return old, new


def _wait(pending: clock.OnThread | None) -> None:
    if pending is not None:
        pending.result()


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
