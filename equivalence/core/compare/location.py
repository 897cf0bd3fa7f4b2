"""Where the two sides part, as a value (``Location``): its kind, the linen and NNX places, the figures
that say so, and the module calls it read (``Module``). ``locate`` finds it; the report draws it.
"""

import dataclasses
import enum
from typing import Any

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
    output_diff: float | None  # ... over its outputs (None: not compared, ``pairing.other_inputs``)
    output_allowed: float | None
    output_floor: float | None
    output_ok: bool

    @property
    def ratio(self) -> float:
        """Output difference over what it was allowed (> 1: it parts)."""
        return over(self.output_diff, self.output_allowed)


class Where(enum.StrEnum):
    """What a ``Location`` names: a place in the first step, or ``NONE`` (nothing parts there) or
    ``UNLOCATED`` (no place could be named with evidence). A ``str``: it prints as its value."""

    MODULE = 'module'  # a module call's output parts while its input agrees
    BETWEEN = 'between'  # a module's input parts while the call before it agreed: the code between them
    RANDOMNESS = 'randomness'  # a module's random draws (a Dropout's mask) differ
    LOSS = 'loss'  # the model's output agrees, the loss does not
    BACKWARD = 'backward'  # the loss agrees, the gradients do not
    STATISTICS = 'statistics'  # the running statistics (BatchNorm's) are updated differently
    UPDATE = 'update'  # the gradients agree, the optimizer's update does not (a slot, the update rule)
    EMA = 'ema'  # the parameters agree, the EMA does not
    COLLECTIVE = 'collective'  # the pmap step's own collective: a loss or gradients not pmean'd
    NONE = 'none'
    UNLOCATED = 'unlocated'

    @property
    def stage(self) -> str | None:
        """The stage of the step it lies in (``STAGES``), None for ``NONE`` and ``UNLOCATED``."""
        forward = (Where.MODULE, Where.BETWEEN, Where.RANDOMNESS)
        return 'forward' if self in forward else None if self in (Where.NONE, Where.UNLOCATED) else self.value


class Unplaced(enum.StrEnum):
    """Why a ``Location`` of kind ``UNLOCATED`` names no place: a value the JSON carries (``why``) and a program
    can branch on, beside the figures' words. Every unlocated ``Location`` has one."""

    NOT_RUN = 'not run'  # the first steps were not recorded: several processes, after --resume-at
    BOOKKEEPING = 'bookkeeping'  # leaves on one side only: nothing numeric differs
    RAISED = 'raised'  # the locating run raised
    DATA_NOT_FINITE = 'data not finite'  # a batch holds NaN or Inf, on both sides
    NOT_REPRODUCED = 'not reproduced'  # a side's recording does not reproduce its run's first loss
    STARTS_APART = 'starts apart'  # the step starts from parameters that differ already, within their floors
    UNOBSERVED = 'unobserved'  # the loss parts, and the forward pass was not observed on both sides
    UNCOMPARED = 'uncompared'  # a call's arrays are of other shapes or in another number: calls may not pair
    BY_EXAMPLE = 'by example'  # an input parts on some examples and agrees on others
    BEFORE_EMA = 'before the EMA'  # only the EMA parts, by what parameters within their floors do
    LOSS_OR_DECAY = 'loss or decay'  # moments part unevenly, as an L2 term or a coupled weight decay gives
    ONE_FACTOR = 'one factor'  # each leaf's moments part by one factor of its own: two places give that
    GRADIENT_OR_SETTING = 'gradient or setting'  # a slot parts by no multiple of itself: a gradient or a setting
    MATCH_UNCONFIRMED = 'match unconfirmed'  # a MATCH: what the recording alone parts at, no leaf confirms
    ACROSS_VERSIONS = 'across versions'  # a reference of another JAX, and no pmap code here to place it against
    UPGRADE = 'upgrade'  # a reference of another JAX; against the pmap code run here, nothing parts
    LATER = 'later'  # a MISMATCH whose recorded steps all agree: it parts later, or adds up below each step's floor
    OUTPUT_UNCOMPARED = 'output uncompared'  # the loss parts, and the model's outermost call was not compared
    METRICS_ONLY = 'metrics only'  # only metrics the steps report part: the training agrees


# The diagnoses (``findings.Finding``, by value) each kind of place is consistent with; a diagnosis of another kind
# disagrees with it, and the report says so under ``where:``. A non-finite, bookkeeping or unmeasured diagnosis, and
# no place, agree with anything.
AGREES = {
    Where.MODULE: ('math',),
    Where.BETWEEN: ('math',),
    Where.RANDOMNESS: ('randomness', 'math'),
    Where.LOSS: ('math',),
    Where.BACKWARD: ('math',),
    Where.STATISTICS: ('state', 'math'),
    Where.UPDATE: ('update', 'optimizer'),
    Where.EMA: ('ema',),
    Where.COLLECTIVE: ('math', 'update', 'optimizer'),
}
ANY_PLACE = ('non-finite', 'bookkeeping', 'unmeasured')

# The stages of one step, in the order it runs them: what the location picture draws, the one that parts marked.
STAGES = ('forward', 'loss', 'backward', 'collective', 'statistics', 'update', 'ema')


@dataclasses.dataclass(frozen=True)
class Location:
    """Where the first step parts: ``kind`` (a ``Where``), the linen and NNX places, and the figures that
    say so."""

    kind: Where  # given as its value ('module', ...) or a member
    legacy: str
    new: str
    figures: str
    modules: tuple[Module, ...] = ()
    first: int | None = None  # the index in ``modules`` of the first call that parts
    notes: tuple[str, ...] = ()  # what was not paired or not observed, and why
    agreed: tuple[str, ...] = ()  # the ``STAGES`` held to their floors before it, and found agreeing
    ruled_out: tuple[str, ...] = ()  # the ``STAGES`` the verdict's own leaves rule out (``locate.stages_for``)
    settings: tuple = ()  # (name, legacy's, the new side's) of the settings the module at the place holds otherwise
    why: Unplaced | None = None  # why no place is named: every UNLOCATED has one, no other kind
    read: tuple[tuple[str, Any], ...] = ()  # the figures' numbers and names, as values (``reading``, ``read``)

    def __post_init__(self):
        object.__setattr__(self, 'kind', Where(self.kind))  # an unknown kind raises here, where it is made
        if (self.kind == Where.UNLOCATED) != (self.why is not None):
            raise ValueError(f'a Location of kind {self.kind} with why={self.why!r}: only an unlocated one says why')

    def unplaced(self, figures: str, why: 'Unplaced') -> 'Location':
        """The same location naming no place: its figures now ``figures``, and ``why`` none is named."""
        return dataclasses.replace(self, kind=Where.UNLOCATED, legacy='', new='', figures=figures, first=None,
                                   settings=(), why=why)  # fmt: skip

    def disagrees(self, finding: str) -> bool:
        """Whether the verdict's diagnosis ``finding`` (a ``findings.Finding``, '' none) is of another kind than this
        place (``AGREES``): a randomness diagnosis beside a module that computes something else."""
        return bool(finding) and finding not in ANY_PLACE and finding not in AGREES.get(self.kind, (finding,))

    @property
    def reading(self) -> dict[str, Any]:
        """What the figures say, as values by name (docs/json.md lists the names): ``apart`` and ``allowed``
        at the place, ``factor``, ``b1``, ``step`` ... ; what a program reads in place of the figures' words."""
        return dict(self.read)

    def line(self) -> str:
        if self.kind in ('none', 'unlocated'):
            return f'where: {self.kind}: {self.figures}'
        return f'where: {self.kind} at {self.legacy} ↔ {self.new}: {self.figures}'

    def lines(self) -> list[str]:
        return [self.line(), *(f'  {note}' for note in self.notes)]

    def to_json(self) -> dict:
        return {
            'kind': self.kind.value,
            'legacy': self.legacy,
            'new': self.new,
            'figures': self.figures,
            'why': self.why.value if self.why is not None else None,
            'read': self.reading,
            'first_module': self.first,
            'notes': list(self.notes),
            'agreed': list(self.agreed),
            'ruled_out': list(self.ruled_out),
            'modules': [dataclasses.asdict(m) for m in self.modules],
        }


def read(**values: Any) -> tuple[tuple[str, Any], ...]:
    """A ``Location.read``: the values given, None left out, numbers as Python's (the JSON carries them)."""
    plain = lambda v: tuple(map(plain, v)) if isinstance(v, tuple | list) else v.item() if hasattr(v, 'item') else v  # noqa: E731
    return tuple((name, plain(v)) for name, v in values.items() if v is not None)


def over(diff: float, allowed: float | None) -> float:
    if allowed is None or not np.isfinite(diff):
        return np.inf
    return diff / allowed if allowed > 0 else (np.inf if diff > 0 else 0.0)


def sci(x: float | None) -> str:
    return '-' if x is None or not np.isfinite(x) else f'{x:.2e}'
