"""Each side's first steps run with every module call recorded (``first_steps``): the pmap side, the new
side and the twin, one call a step, under ``intercept``'s patched module calls; what building a setup
called is dropped (``_first_call``), each call's records kept apart (``_next_call``).
"""

import dataclasses
import functools

import jax
from flax import nnx

from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Run
from equivalence.core.record import pruned
from equivalence.core.record.intercept import (
    _RECORDINGS,
    _SESSION,
    _SESSIONS,
    GRADS,
    ROWS,
    STATISTICS_NAMES,
    _patched,
    first_rows,
)
from equivalence.core.record.recorded import host, in_order
from equivalence.core.rng import draws, randomness
from equivalence.core.run import facts, sides
from equivalence.core.run.inputs import Inputs
from equivalence.core.run.model_side import Reordered
from equivalence.core.run.nudge import Nudged
from equivalence.core.twins import probe, twin


def step_batch(calls: list, j: int):
    """Step ``j``'s global batch ``[1, G, ...]`` (0-based, counted over every call's steps)."""
    k = jax.tree.leaves(calls[0])[0].shape[0]
    return jax.tree.map(lambda v: v[j % k : j % k + 1], calls[j // k])


@dataclasses.dataclass
class Reuse:
    """What the recordings of one verdict share (``Recorder``): one user context (``session``), so that JAX
    keeps their traces, and each side's compiled call (``programs``), which every setup builds anew: the
    first steps, then steps 1 to 2 and 1 to 8 where the first step shows nothing (one step a call, so one
    program a side), compiled once."""

    session: int = dataclasses.field(default_factory=lambda: next(_SESSIONS))
    programs: dict = dataclasses.field(default_factory=dict)

    def share(self, side: str, setup):
        self.programs[side] = setup.shared(self.programs.get(side))
        return setup


def first_steps(kind: Kind, config: Run, inputs: Inputs, n_twin: twin.TwinKind | None, steps: int = 1,
                forward: bool = False, reuse: Reuse | None = None, only_legacy: bool = False):  # fmt: skip
    """``({side: PathResult after ``steps`` steps}, {side: {label: Record}})``: the first ``steps``
    steps of each side (legacy, nnx, and twin when ``n_twin``: a count, or a sharded run's
    ``twin.Reordered``), each a call of its own, every module call recorded; a ``Record`` holds the
    last step's values (a call starts when the one before it has ended, its callbacks with it). Every
    trace is made afresh, keyed apart by a user context of this recording's own (``_RECORDINGS``; ``reuse``:
    shared with the verdict's other recordings of the same kind): a loop port's jitted functions trace
    again with the recording in them, and no other run takes a recording trace, nor does this one take
    theirs; nothing is cleared. ``forward``: the forward pass alone, each call compiled with only what its
    callbacks and its losses need (``setup.forward``): the results' states are the states before the step,
    and no gradient or cotangent is recorded. ``only_legacy``: the pmap side alone (a reference's recording);
    ``inputs.recorded``: the pmap side's, read from a reference, not run."""
    reuse = reuse or Reuse()
    one = dataclasses.replace(probe.probe_config(config), steps_per_call=1, calls=steps)
    first, recording = [step_batch(inputs.calls, j) for j in range(steps)], kind.recording()
    fed = dataclasses.replace(inputs, calls=first)
    hooks = {'after_call': _next_call, 'before_call': _first_call, 'forward': forward}
    runs = {} if only_legacy else {
        'new': (lambda: recording.new_setup(one, fed),
                lambda setup: sides.run_new(recording, one, fed, setup=setup, **hooks)),
    }  # fmt: skip
    if n_twin and not only_legacy:
        runs['twin'] = (lambda: recording.twin_setup(one, inputs, n_twin),
                        lambda setup: twin.run_twin(recording, one, dataclasses.replace(fed, whole=None), n_twin,
                                                    setup=setup, **hooks))  # fmt: skip
    abstract = None if only_legacy else facts.abstract_model(kind.port)  # None: a new side of linen alone
    graph = nnx.iter_graph(abstract) if abstract is not None else ()
    classes = {type(m) for _, m in graph if isinstance(m, nnx.Module)}
    results, s, compiling, rows = {}, _SESSION, None, None
    s.raw, s.counts, s.order, s.call, s.forward, s.draws = {}, [], 0, 0, forward, {}
    # each value kept to the first rows of each device's batch (``intercept.sampled``), but where a twin lays its
    # rows out otherwise (``Reordered``: put back in the run's order whole, ``recorded.in_order``)
    s.rows = s_rows = None if isinstance(n_twin, Reordered) else (ROWS, config.devices, config.batch_size)
    try:
        with _patched(classes), _RECORDINGS(reuse.session), draws.recording([]), pruned.at_recording_level():
            # The pmap side is traced first, as it always was, and compiles on a thread while the new side
            # and the twin run; it runs last, its values recorded then (a callback reads the side as it runs).
            if inputs.recorded is None:
                s.side, s.axis, s.mesh, s.call = 'legacy', kind.axis_name, None, -1  # building: not kept
                legacy_setup = reuse.share('legacy', recording.legacy_setup(one, fed))
                # forward: its forward pass alone, traced now and compiled on a thread beside the new side's
                # (the hold of a MATCH at 2e5 parameters: 10 s of a 30 s check, each side's program a third)
                compiling = sides.prefetch(legacy_setup, fed, forward)
                s.side = None
                legacy_run = lambda setup: sides.run_legacy(recording, one, fed, setup=setup, **hooks)  # noqa: E731
                runs['legacy'] = (lambda: legacy_setup, legacy_run)
            for side, (build, run) in runs.items():
                s.side, s.axis, s.mesh, s.call = side, None, None, -1  # building: not kept
                same = side == 'twin' and isinstance(n_twin, Nudged)  # the run's own program: the new side's
                setup = reuse.share('new' if same else side, build())
                rows = getattr(setup, 'rows', None) if side == 'twin' else rows  # a Reordered twin's row order
                s.axis = kind.axis_name if side == 'legacy' else None
                s.mesh = kind.recording_mesh(setup) if side != 'legacy' else None
                if side == 'legacy' and compiling is not None:
                    compiling.result()
                results[side] = run(setup)
                jax.effects_barrier()
                s.side = None
                draws.into([])  # what the next side's building draws is not its step's
                # the new side's module called once for each device's rows (a Python loop over them): one call
                s.raw[side] = host(s.raw.get(side, {}), 1 if side == 'legacy' else config.devices)
                results[side].draws = draws.own(draws.Draws(s.draws.get(side, [])))
    finally:
        if compiling is not None:
            compiling.result()  # no compile left running, whatever raised
        s.side, s.mesh, s.axis, s.forward, s.rows = None, None, None, False, None
        randomness.take_unbridged()  # the checked runs' lines were taken; these are the same layers'
    if rows is not None:
        s.raw['twin'] = {label: in_order(record, rows) for label, record in s.raw['twin'].items()}
    if inputs.recorded is not None:  # recorded by this rule (``referenced.record``), or whole before it was one
        results['legacy'], held = inputs.recorded.first_steps(steps, forward)
        s.raw['legacy'] = rows_kept(held, config.batch_size // config.devices) if s_rows else held
    return results, s.raw


def rows_kept(raw: dict, per_device: int) -> dict:
    """A reference's records (recorded whole before ``intercept.sampled`` kept ``ROWS`` rows) cut as it cuts: not
    the gradients, nor a BatchNorm's (kept whole by the recorder, as the new side's are: cut here, a check against a
    reference stopped at the first BatchNorm, its inputs of other shapes on the two sides)."""
    if ROWS >= per_device:
        return raw
    cut = functools.partial(first_rows, per_device=per_device)
    return {
        label: r if label == GRADS or r.cls in STATISTICS_NAMES else
        r._replace(values={d: ([cut(a) for a in i], [cut(a) for a in o]) for d, (i, o) in r.values.items()})
        for label, r in raw.items()
    }  # fmt: skip


def _first_call() -> None:
    """Before the first recorded call, once its setup is built: what building it called (a linen model
    initialised inside ``nnx.bridge.ToNNX``) was not the step, and is dropped."""
    jax.effects_barrier()
    side = _SESSION.raw.get(_SESSION.side, {})
    for label in [k for k, entry in side.items() if all(call < 0 for call, *_ in entry[3])]:
        del side[label]
    for entry in side.values():
        entry[3][:] = [e for e in entry[3] if e[0] >= 0]
    _SESSION.call = 0
    draws.into(_SESSION.draws.setdefault(_SESSION.side, []))  # the step's own random draws, from here


def _next_call(setup, calls_done: int, rng) -> None:
    """After each recorded call: its callbacks have all run (``effects_barrier``); what follows is the next's."""
    jax.effects_barrier()
    _SESSION.call = calls_done
