"""One corpus entry: a port, what is true of it, and the runs that judge the verdict on it.

No JAX here: the family modules that build the ports import it, and only when loaded.
"""

import dataclasses
from typing import Any

TRUTHS = ('correct', 'slip')
# The diagnosis kinds of issue 16's verdict, plus 'state' for a slip that only the step's own
# state update sees (BatchNorm statistics: no loss, gradient or parameter of step 1 differs), and
# 'ema' for one that only the EMA's leaves see.
KINDS = ('math', 'randomness', 'optimizer', 'state', 'ema', 'non-finite', 'bookkeeping')


@dataclasses.dataclass(frozen=True)
class Entry:
    """A port whose truth is known: ``correct`` (ill-conditioned on purpose) or a ``slip``."""

    name: str
    truth: str  # 'correct': the verdict must be MATCH; 'slip': MISMATCH
    port: Any  # an equivalence ModelPort or LoopPort
    what: str  # one line: why this correct port is hard, or which constant is off
    kind: str | None = None  # slips: the diagnosis kind the verdict should name
    flags: dict = dataclasses.field(default_factory=dict)  # RunConfig fields of every run (strategy, rng_mode, ...)
    devices: tuple[int, ...] | None = None  # device counts to run; None: the command's list
    min_seeds: int = 1  # at least this many seeds, whatever the command asks
    quick: bool = False  # in the --quick subset

    def __post_init__(self):
        if self.truth not in TRUTHS:
            raise ValueError(f'{self.name}: truth must be one of {TRUTHS}, got {self.truth!r}')
        if (self.truth == 'slip') != (self.kind is not None) or (self.kind and self.kind not in KINDS):
            raise ValueError(f'{self.name}: a slip names one of {KINDS}, a correct port none; got {self.kind!r}')

    def device_counts(self, requested: tuple[int, ...]) -> tuple[int, ...]:
        """The requested counts, or those of this entry's own that were requested (maybe none)."""
        return requested if self.devices is None else tuple(d for d in self.devices if d in requested)

    def seeds(self, requested: int) -> range:
        return range(max(requested, self.min_seeds))
