"""What one benchmark run measured: the variants, their timed blocks and compiles, and the ratios
the report and the advice both read."""

import dataclasses
import statistics

import numpy as np

from equivalence.bench.timing import Block, CompileTiming
from equivalence.bench.variants import Variant
from equivalence.core.compare import compare
from equivalence.core.compare.outcome import Outcome
from equivalence.core.port.config import RunConfig


def rate(x: float) -> str:
    """Steps per second as printed: whole numbers, or two decimals below 100 (a model whose step takes seconds)."""
    return f'{x:.0f}' if x >= 100 else f'{x:.2f}'


@dataclasses.dataclass
class BenchResult:
    config: RunConfig  # the command's flags
    repeats: int
    machine: dict
    variants: list[Variant]
    blocks: dict[str, list[Block]]
    compiles: dict[str, CompileTiming]
    scaling: dict[int, CompileTiming]  # the shipped call compiled at K=5 and K=100
    first: dict[str, np.ndarray]  # each variant's first-call losses, same inputs for all
    notes: list[str] = dataclasses.field(default_factory=list)  # a loop port: what could not be derived
    placement: list[str] = dataclasses.field(default_factory=list)  # the gradient all-reduce's fallback, and why
    k_scaling: int = 20  # the long fused K timed beside K and one step per call (``--k-scaling``)

    def steps(self, name: str) -> list[float]:
        return [b.steps_per_s for b in self.blocks[name]]

    def median(self, name: str, field: str = 'steps_per_s') -> float:
        return statistics.median(getattr(b, field) for b in self.blocks[name])

    def baseline(self, v: Variant) -> str:
        """The legacy row with the same K, else the fused legacy row."""
        same_k = [u.name for u in self.variants if u.name.startswith('legacy') and u.steps_per_call == v.steps_per_call]
        return same_k[0] if same_k else 'legacy'

    def paired(self, name: str, base: str, field: str = 'steps_per_s') -> list[float]:
        """Per-repeat ratios: the blocks of one repeat ran close together, under the same load."""
        pairs = zip(self.blocks[name], self.blocks[base], strict=True)
        return [getattr(a, field) / getattr(b, field) for a, b in pairs]

    def agreement(self, v: Variant) -> compare.Report:
        """First-call losses against legacy pmap's, over the steps both ran: one leaf, ``losses/<variant>``."""
        ref, got = self.first['legacy'], self.first[v.name]
        n = min(len(ref), len(got))
        return compare.compare({'losses': {v.name: ref[:n]}}, {'losses': {v.name: got[:n]}})

    def agrees(self, v: Variant) -> bool:
        """The agreement's outcome (the fixed screen's, ``compare.Report.outcome``) is MATCH."""
        return self.agreement(v).outcome is Outcome.MATCH
