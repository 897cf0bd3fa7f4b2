"""What a verdict found and what it did, as typed values: the diagnosis (a ``Finding`` with the leaves and
figures behind it), why a run is NOT VERIFIED (``Unmeasured``, ``Hidden``), and the records of each step the
verdict took (the screen, the twins and where they ran, the probes, what was skipped and why).

No sentence is made here: ``core/report/words`` writes the English from these values, and the JSON and the
text read it there. ``Outcome`` (``outcome``) is the one value a command reads to end.
"""

import dataclasses
import enum

from equivalence.core.compare.compare import LeafDiff


class Finding(enum.StrEnum):
    """What a MISMATCH is, the first that explains it (``rule.diagnose``); compares equal to its name."""

    NON_FINITE = 'non-finite'
    BOOKKEEPING = 'bookkeeping'
    MATH = 'math'
    RANDOMNESS = 'randomness'
    STATE = 'state'
    EMA = 'ema'
    METRICS = 'metrics'  # only metrics the steps report differ: the training agrees
    OPTIMIZER = 'optimizer'
    UPDATE = 'update'
    UNMEASURED = 'unmeasured'


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """Where the first NaN or Inf appeared: per side ``(side, its first non-finite step (from 1) or None, the first
    non-finite leaf where the losses are finite, or None)``, and the first step whose batch holds one."""

    where: tuple[tuple[str, int | None, str | None], ...]
    data_step: int | None = None


@dataclasses.dataclass(frozen=True)
class NoTwin:
    """Why no twin measured a floor, or why one twin did not (``twin``: the twin module's own reason)."""

    class Why(enum.Enum):
        NO_MESH = 'no-mesh'  # ``detail``: why no fresh process either ('' : an odd batch)
        SCREEN_PASSED = 'screen-passed'
        TWIN = 'twin'  # ``detail``: what became of it ('not run: ...', 'refused: ...'), said by ``verdict.twin``

    why: Why
    detail: object = ''  # NO_MESH: why (a str); TWIN: the twin's own words, or a ``TwinRefused``


@dataclasses.dataclass(frozen=True)
class Twins:
    """The twins whose floor every leaf was held to (``model_side.TwinKind``s), in how many processes each ran
    its own, and those that ran in a fresh process."""

    kinds: tuple
    processes: int = 1
    fresh: tuple = ()


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """A MISMATCH's finding and what it rests on; ``core/report/words.diagnosis`` says it."""

    kind: Finding
    leaves: tuple[LeafDiff, ...] = ()  # the leaves it names: the first step's (math, randomness) or the later ones
    sided: tuple[LeafDiff, ...] = ()  # leaves on one side only: the finding (bookkeeping), or said beside it
    nonfinite: NonFinite | None = None
    grads_checked: bool = False  # the first step's gradients were held too
    placed: str | None = None  # the stage before the update that the first step's records found (math)
    no_floor: NoTwin | None = None  # unmeasured: why no twin measured a floor


@dataclasses.dataclass(frozen=True)
class Unmeasured:
    """NOT VERIFIED: no twin measured this port's floor where it would decide (``unverified.unmeasured``)."""

    twin: NoTwin | None
    screen_passed: bool
    failed: tuple[LeafDiff, ...] = ()  # outside the fixed screen, where it failed


@dataclasses.dataclass(frozen=True)
class Hidden:
    """NOT VERIFIED: the noise-dominated leaves are where a slip would hide (``rule.not_verified``)."""

    share: float | None  # of the parameters' elements noise-dominated, where more than ``rule.NOT_VERIFIED_SHARE``
    noisy: tuple[LeafDiff, ...] = ()  # the noise-dominated parameters
    head: tuple[LeafDiff, ...] = ()  # those of the output layer
    losses: bool = False  # the per-step losses are noise-dominated


@dataclasses.dataclass(frozen=True)
class Thin:
    """NOT VERIFIED: every leaf within its floor, but some leaf's difference grows every call as a slip in the
    update would, too weakly over these steps to decide (``systematic.Reading.suggestive``)."""

    trends: tuple  # systematic.Trend: each suggestive one
    steps: int  # the steps read
    decide: int  # the steps that would decide


# -- what the verdict did, step by step ----------------------------------------------------------


class Probe(enum.Enum):
    """A step the verdict may take beyond the twins."""

    GRADS = 'grads'
    LEGACY_TWIN = 'legacy-twin'
    RERUN = 'rerun'
    HELD = 'held'  # a MATCH's first step held module by module (``hidden``)


@dataclasses.dataclass(frozen=True)
class Screen:
    passed: bool  # the fixed tolerance held every leaf


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device of one call of the run and of each twin (``footprint.per_device``)."""

    run: dict | None
    twins: dict


@dataclasses.dataclass(frozen=True)
class Probed:
    probe: Probe
    agree: bool  # the gradients agree, the re-run matches


@dataclasses.dataclass(frozen=True)
class NotRun:
    probe: Probe
    why: str  # why it cannot run here (``Inputs.single_process_probes``)


@dataclasses.dataclass(frozen=True)
class LegacyTwin:
    """The pmap side's own twin (``legacy_twin.run``): whether it measured, and on how many devices."""

    class Ran(enum.Enum):
        MEASURED = 'measured'
        NOT_RUN = 'not-run'  # ``why``: before it ran
        RAISED = 'raised'  # ``why``: the first line of what it raised
        REFUSED = 'refused'  # ``why``: why it does not compute what the pmap run computes

    class Skip(enum.Enum):
        """Why it was not run, where the verdict decided so."""

        NO_COUNT = 'no-count'  # no second device count fits
        ONE_CALL = 'one-call'  # with one call there is no early state to tell chaos from a real difference

    ran: Ran
    devices: int | None = None
    why: object = ''  # NOT_RUN: a ``Skip``, an ``Excess`` (NNX off early) or why not here; RAISED: its first
    # line; REFUSED: a ``Refusal``
    rows: int | None = None  # it drew with the run's per-device keys, this many rows
    # REFUSED where the run's keys are per device and the twin is not handed them (a loop port's own step): the
    # run's device count. Expected, not a fault: a step that draws from its device's key draws otherwise there.
    keys_of: int | None = None


@dataclasses.dataclass(frozen=True)
class Held:
    """The first step held module by module, a MATCH's noise-dominated leaves verified there (``hidden``)."""

    reproduced: bool = True  # its recording reproduces the run
    calls: int = 0  # module calls held
    part: tuple[str, str] | None = None  # (the location's kind, the module call) where it parts
    whole_failed: bool = False  # the whole step could not be recorded: the forward pass alone decided
    alone: LeafDiff | None = None  # the forward pass alone parted here, the whole step did not


# -- why a twin measures no floor ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Excess:
    """A parameter already farther from the legacy run after the first call than the NNX twin allows there
    (``rule.early_excess``): chaos starts at rounding level, so this is no chaos."""

    path: str
    spread: float
    limit: float


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a twin that ran is refused as a floor: it does not compute what the run computes."""

    class Why(enum.Enum):
        NON_FINITE = 'non-finite'  # a non-finite loss at ``step`` (``run``, ``twin``: the two losses)
        SPACINGS = 'spacings'  # its loss at ``step`` is ``spacings`` float32 spacings from the run's
        SAME_ORDER = 'same-order'  # it ended in bitwise the new side's state: no reordering, no floor
        DRAWS = 'draws'  # ``detail``: how its random draws differ from the run's (``run.draws.refusal``)
        OWN_NON_FINITE = 'own-non-finite'  # the run's own program: its loss at ``step`` finite on one only
        ANY_NON_FINITE = 'any-non-finite'  # a legacy twin: some loss not finite
        EARLY = 'early'  # a legacy twin: ``excess`` after the first call, on another count

    why: Why
    step: int = 0
    run: float = 0.0
    twin: float = 0.0
    spacings: float = 0.0
    side: str = 'new'  # whose run it is held to: 'new', or 'legacy' for a legacy twin
    detail: str = ''
    excess: Excess | None = None


@dataclasses.dataclass(frozen=True)
class TwinRefused:
    """A twin of the verdict's (``twin.measure``) refused as a floor: which, why, where it ran."""

    kind: object  # its ``model_side.TwinKind``
    refusal: Refusal
    fresh: bool = False  # it ran in a fresh process
    per_replica: bool = False  # on another device count: the likely cause said (``words.PER_REPLICA``)


@dataclasses.dataclass(frozen=True)
class Unrun:
    """A twin of the verdict's that did not run (``twin.measure``): which, and what stopped it."""

    kind: object  # its ``model_side.TwinKind``
    raised: str | None = None  # the first line of what it raised here; None: more devices than this process sees
    no_fresh: str = ''  # why no fresh process could run it either (``fresh.why_not``) ...
    fresh_raised: str = ''  # ... or the first line of what the fresh process raised
    ratio: float | None = None  # not run: it would hold this many times the run's bytes per device
    own: bool = False  # the run's own program, which raised on nudged inputs
