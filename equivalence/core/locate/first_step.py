"""The first step, once more on each side and on the twin, every module call recorded (``intercept``):
what the gradient probe and the location read, recorded once per verdict (``Recorder``); and the first
step's other probes (the deterministic re-run, the first step whose data is not finite).
"""

import dataclasses
import functools

import jax
import numpy as np

from equivalence.core.compare import compare, rule
from equivalence.core.compare.rule import MEASURED_FLOOR
from equivalence.core.locate import recorded_run
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Run
from equivalence.core.record.pairing import recorded_grads
from equivalence.core.rng import randomness
from equivalence.core.run import sides
from equivalence.core.run.inputs import Inputs
from equivalence.core.twins import probe, twin


def here(n_twin: twin.TwinKind | None, config: Run, fresh: tuple = ()) -> twin.TwinKind | None:
    """The twin the first steps run in this process: None where it ran in a fresh process (``fresh``:
    it needs more devices than this process sees, or it raised here, as code pinned to a mesh of its
    own does), or needs more devices than this process sees."""
    if n_twin is None or n_twin in fresh:
        return None
    return None if twin.devices_of(n_twin, config) > len(jax.local_devices()) else n_twin


@dataclasses.dataclass(frozen=True)
class Recorder:
    """The checked runs' first step recorded once (``runs``, on first use): the gradient probe and the
    location share it. ``twin``: the twin it runs beside, as ``here`` keeps it (None: no twin, each value
    then held to 8 float32 spacings)."""

    kind: Kind
    config: Run
    inputs: Inputs
    twin: twin.TwinKind | None

    @functools.cached_property
    def reuse(self) -> recorded_run.Reuse:
        """What the whole step's recordings share (``recorded_run.Reuse``): ``runs`` and every ``steps``."""
        return recorded_run.Reuse()

    @functools.cached_property
    def runs(self) -> tuple[dict, dict]:
        """``({side: PathResult}, {side: {label: Record}})`` of the first step (``recorded_run.first_steps``)."""
        return recorded_run.first_steps(self.kind, self.config, self.inputs, self.twin, reuse=self.reuse)

    @functools.cached_property
    def forward(self) -> tuple[dict, dict]:
        """``runs``' forward pass alone (``recorded_run.first_steps(forward=True)``: what each module call took
        and gave, and each side's first loss; no gradient, no state after the step), for a fraction of its
        compile; ``runs`` itself where it was recorded already, or where a side's call cannot be traced as
        one program (host work inside it)."""
        if self.recorded_whole:
            return self.runs
        try:
            return recorded_run.first_steps(self.kind, self.config, self.inputs, self.twin, forward=True)
        except Exception:  # noqa: BLE001 -- recorded whole instead; a port's own error raises there again
            return self.runs

    @property
    def recorded_whole(self) -> bool:
        """Whether ``runs`` (the whole step's recording) is recorded already: ``forward`` then is it."""
        return 'runs' in self.__dict__

    def steps(self, n: int) -> tuple[dict, dict]:
        """The first ``n`` steps recorded (a fresh recording: only the last one is kept), on the programs that
        ``runs`` compiled (one step a call)."""
        return recorded_run.first_steps(self.kind, self.config, self.inputs, self.twin, n, reuse=self.reuse)


def grads(recorder: Recorder) -> dict[str, dict]:
    """``{'legacy', 'new', 'twin'}`` -> the first gradient by NNX path (the twin's: NNX's without a
    twin), as each optimizer was given it. Where the recorded steps cannot run, the plain probe's
    (``probe.first_steps``): the location then says why it has none, and the verdict is as it was."""
    kind, config, inputs = recorder.kind, recorder.config, recorder.inputs
    try:
        raw = recorder.runs[1]
    except Exception:  # noqa: BLE001 -- a port's own error raises again below, as it always did
        if inputs.recorded is not None:  # the plain probe runs the pmap side, which a reference holds recorded
            raise
        twin_setup = kind.twin_setup(config, inputs, recorder.twin) if recorder.twin else None
        steps = probe.first_steps(kind, config, inputs, twin_setup)
        return {side: steps[side].grads for side in ('legacy', 'new', 'twin')}
    found = {side: recorded_grads(raw, side, inputs.mapping) for side in ('legacy', 'new', 'twin')}
    return {**found, 'twin': found['twin'] or found['new']}


def grads_report(recorder: Recorder) -> compare.Report:
    """The first step's gradients of both sides, held to the floor of the twin's (0 without one)."""
    got = grads(recorder)
    ref, other, floor = (rule.first_step_tree(grads=got[s]) for s in ('legacy', 'new', 'twin'))
    return compare.compare_to_floor(ref, other, floor, MEASURED_FLOOR)


def deterministic_rerun_matches(kind: Kind, config: Run, inputs: Inputs, report: compare.Report) -> bool:
    """The first call again, both sides, every bridged Dropout off: do the first losses now agree?

    A user's own jitted step (a loop port) keeps its traces across calls, and the bridge acts
    only while tracing: ``dropout_off`` keys the traces it makes apart from the bridged ones
    (``randomness``), so the re-run traces again and no later run reuses a trace without dropout,
    with no cache cleared."""
    one, first = dataclasses.replace(config, calls=1), dataclasses.replace(inputs, calls=inputs.calls[:1])
    with randomness.dropout_off():
        old, new = sides.both_sides(kind, one, first)
    leaf = next((x for x in report.leaves if x.name == 'first_step/loss'), None)
    limit = leaf.limit if leaf is not None and leaf.limit is not None else 0.0
    allowed = max(limit, MEASURED_FLOOR.min_ulps * compare.spacing32(float(old.losses[0])))
    return bool(abs(float(old.losses[0]) - float(new.losses[0])) <= allowed)


def data_nonfinite(calls: list) -> int | None:
    """The first step (1-based) whose batch holds NaN or Inf, or None (every process sees every row)."""
    step = 0
    for batch_KxG in calls:
        leaves = [np.asarray(v) for v in jax.tree.leaves(batch_KxG)]
        for k in range(leaves[0].shape[0]):
            step += 1
            if any(np.issubdtype(v.dtype, np.floating) and not np.isfinite(v[k]).all() for v in leaves):
                return step
    return None
