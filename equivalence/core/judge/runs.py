"""What the verdict has run beyond the two checked runs, asked of one object (``Runs``): the twins, the
pmap side's own twin, the deterministic re-run, the first steps recorded. The policy (``judge``) decides what
to measure, in what order, and what each finding means; ``Runs`` runs it, on the check's kind, config and
inputs, which it holds. ``harness.judgement`` hands the policy one for each verdict.
"""

import dataclasses
import functools

from equivalence.core.locate import first_step
from equivalence.core.locate.first_step import Recorder
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Run
from equivalence.core.run import facts
from equivalence.core.run.inputs import Inputs
from equivalence.core.twins import legacy_twin, twin


@dataclasses.dataclass(frozen=True)
class Runs:
    """The runs a verdict asks for, on the check's ``kind``, ``config`` and ``inputs``."""

    kind: Kind
    config: Run
    inputs: Inputs

    def twins(self, new, counts: tuple) -> twin.Measured:
        """Each twin of ``counts`` that ran and computes what the run computes (``twin.measure``)."""
        return twin.measure(self.kind, self.config, new, self.inputs, counts)

    def legacy_twin(self, old, new, twins: dict) -> tuple:
        """``(the pmap side's own twin or None, what was done, what it raised)`` (``legacy_twin.run``)."""
        return legacy_twin.run(self.kind, self.config, old, new, twins, self.inputs)

    def rerun(self, report) -> bool:
        """Whether the first losses agree, every bridged Dropout off (``first_step.deterministic_rerun_matches``)."""
        return first_step.deterministic_rerun_matches(self.kind, self.config, self.inputs, report)

    @functools.cached_property
    def dropout(self) -> bool:
        """Whether the port's model has Dropout (``facts.uses_dropout``)."""
        return facts.uses_dropout(self.kind.port)

    def recorder(self, n_twin: twin.TwinKind | None) -> Recorder:
        """The checked runs' first step, recorded once on first use, beside the twin ``n_twin`` (``Recorder``)."""
        return Recorder(self.kind, self.config, self.inputs, n_twin)
