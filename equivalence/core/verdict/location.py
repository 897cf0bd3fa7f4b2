"""Where the two sides part, as a value (``Location``): its kind, the linen and NNX places, the figures
that say so, and the module calls it read (``Module``). ``locate`` finds it; the report draws it.
"""

import dataclasses

import numpy as np

ROOT = '(the model)'  # how the outermost module call is shown


@dataclasses.dataclass(frozen=True)
class Module:
    """One paired module call, in the order the pmap side's calls finished."""

    legacy: str
    new: str
    cls: str
    input_diff: float  # max |nnx - legacy| over its array inputs (the worst against what it was allowed)
    input_allowed: float | None
    input_ok: bool
    output_diff: float  # ... over its outputs
    output_allowed: float | None
    output_floor: float | None
    output_ok: bool

    @property
    def ratio(self) -> float:
        """Output difference over what it was allowed (> 1: it parts)."""
        return over(self.output_diff, self.output_allowed)


@dataclasses.dataclass(frozen=True)
class Location:
    """Where the first step parts: ``kind`` (module, between, randomness, loss, backward, statistics,
    update, none, unlocated), the linen and NNX places, and the figures that say so."""

    kind: str
    legacy: str
    new: str
    figures: str
    modules: tuple[Module, ...] = ()
    first: int | None = None  # the index in ``modules`` of the first call that parts
    notes: tuple[str, ...] = ()  # what was not paired or not observed, and why

    def line(self) -> str:
        if self.kind in ('none', 'unlocated'):
            return f'where: {self.kind}: {self.figures}'
        return f'where: {self.kind} at {self.legacy} ↔ {self.new}: {self.figures}'

    def lines(self) -> list[str]:
        return [self.line(), *(f'  {note}' for note in self.notes)]

    def to_json(self) -> dict:
        return {
            'kind': self.kind,
            'legacy': self.legacy,
            'new': self.new,
            'figures': self.figures,
            'first_module': self.first,
            'notes': list(self.notes),
            'modules': [dataclasses.asdict(m) for m in self.modules],
        }


def over(diff: float, allowed: float | None) -> float:
    if allowed is None or not np.isfinite(diff):
        return np.inf
    return diff / allowed if allowed > 0 else (np.inf if diff > 0 else 0.0)


def sci(x: float | None) -> str:
    return '-' if x is None or not np.isfinite(x) else f'{x:.2e}'
