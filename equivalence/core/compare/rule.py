"""The verdict: every leaf held to the noise floor a twin run measured, and a typed diagnosis saying why not.

Framework-free, like ``compare``: named host arrays and numbers in, a ``Verdict`` out. What
runs the twin and the probes is ``judge``; this module holds the rules and their numbers. The values it
returns (``findings``) are worded by ``core/report/words``.

The statistic, per leaf (the per-step losses are one leaf; the first step's loss and, at
level 1, the first step's gradients are leaves of their own, ``first_step/...``):

    floor = max |nnx - twin|     (the twin: the NNX run again, only the reductions reordered)
    ok    when max |nnx - legacy| <= max(SAFETY * floor, MIN_ULPS spacings of max |legacy|, FLIPS moved)
          (the spacings are float32's, or the leaf's own dtype's where narrower: a bfloat16 moment)
    moved = for a parameter fed by optimizer state narrower than float32 (optax ``accumulator_dtype``,
            ``mu_dtype``): that dtype's spacing at max |legacy - start|, its change over the run
            (``compare.moved_spacing``); 0 otherwise

and a leaf whose floor exceeds NOISE_REL of its own largest value (on either side) is NOISE-DOMINATED:
reported with its figure, not failed, because its final value cannot verify anything.

Where that fails with the first step (loss and, for a model port, gradients) within its floor,
a difference that grew over the updates, the legacy run is done again on another device count
(``judge.legacy_twin``) and each leaf's floor is the larger of ``max |nnx - twin|`` and
``max |legacy - legacy twin|``: chaos on the pmap side is noise too, and no NNX twin sees it.
"""

import dataclasses
from typing import Any

import numpy as np

from equivalence.core.compare import compare
from equivalence.core.compare.compare import FloorRule, LeafDiff, Report, spacing32
from equivalence.core.compare.findings import (
    Diagnosis,
    Excess,
    Finding,
    Hidden,
    NonFinite,
    NoTwin,
    Refusal,
    Thin,
    Twins,
    Unmeasured,
)
from equivalence.core.compare.outcome import Outcome

# Measured (scratch sweep, legacy / NNX / twin on the same inputs, default 4 calls x 5 steps):
# 36 correct runs (mlp, wide, score: D in {1, 2, 8}, seeds 0-3) and 19 at D=8 with Adam eps 1e-8
# (cnn: dp, fsdp, tp, fsdp-tp, seeds 0 and 3, and --rng global seed 3; wide: all five
# strategies, seeds 0 and 1). SAFETY: on leaves beyond the ulp minimum, max |nnx - legacy| /
# max |nnx - twin| reached 5.5 (cnn tp seed 3, params/hidden/kernel: 3.3e-7 against a floor
# of 6.0e-8), 3.9 (cnn fsdp-tp), 3.05 (wide fsdp-tp); 10 leaves a margin of 1.8 over the worst.
# Slips measured far beyond it: LayerNorm eps 1e-5 for 1e-6, leaf ratios up to 199 (FACTS),
# its first-step loss 19x its limit; --perturb 1e-5 on mlp at D=8, 13x to 34x.
# MIN_ULPS: where the twin rounds like NNX (floor 0 on a leaf), legacy still differs by
# reduction order: up to 8 spacings of the leaf's largest value on correct runs (score D1,
# D8), the first step's loss up to 1. NOISE_REL: a floor above 0.1% of the leaf's own scale
# is chaos, not rounding (bias before BatchNorm: floor 7.8e-3 on values ~1e-2, FACTS); the
# largest correct floor measured relative to its leaf was 5.5e-5 (cnn tp seed 0, hidden/kernel).
# FLIPS: a parameter fed by a bfloat16 moment moves by about one bfloat16 spacing of its change over
# the run where the two runs round one element of the moment apart (derived: compare.moved_spacing).
# Measured (examples/vit_port, bfloat16 momentum, D = 1, 2, 4, 8, seeds 0-2): at most 0.20 of it;
# the float32 rule failed 6 of those 12 correct runs. A slip in one encoder block moved them by 0.61
# (caught by the losses, which stay float32: docs/verdict.md, precision).
MEASURED_FLOOR = FloorRule(
    safety=10.0,
    min_ulps=8.0,
    flips=1.0,
    noise_rel=1e-3,
    reason='each leaf within 10x its measured floor |nnx - twin|, or 8 spacings of its largest value in its precision',
)

# The twin must compute what the checked NNX run computes: its losses at steps 1 and 2 (before
# and after one update, before Adam's amplification builds up) within TWIN_ULPS spacings of
# the checked run's. Measured on correct twins: at most 1 spacing. A twin with lr * (1 + 1e-3)
# is off by 40+ at step 2; LayerNorm eps 1e-5 for 1e-6 by 16 at step 1 (FACTS).
TWIN_ULPS = 8.0

# NOT VERIFIED: every leaf compares, but the noise-dominated ones are where a slip would hide, so the
# run is neither MATCH nor MISMATCH (exit 5): more than NOT_VERIFIED_SHARE of the parameters'
# elements, any parameter of the output layer (everything the model computes reaches the loss
# through it), or the per-step losses. A noise-dominated leaf is verified only through the leaves
# downstream of it; these have too little, or nothing, downstream. Correct runs measured: at most
# 4.2% of the parameters (the corpus's bias before BatchNorm, 32 of 769 elements; the ViT example's
# attention key biases 0.6%, cnn under fsdp seed 4 0.3%), never the output layer (docs/verdict.md).
NOT_VERIFIED_SHARE = 0.1

KINDS = tuple(Finding)  # a MISMATCH's findings, in the order ``diagnose`` tries them


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The measured verdict of one run, as values: its outcome, decided once (``judge``), what was done, and
    on MISMATCH the diagnosis. ``core/report/words`` says it in English."""

    outcome: Outcome
    mode: str  # RunConfig.verdict: 'measured', 'strict' or 'screen'
    done: tuple = ()  # what was measured, in the order it was done (``findings``: Screen, Twins, Probed, ...)
    twin: Twins | NoTwin | None = None  # the twins the floor is from, or why there is no floor
    diagnosis: Diagnosis | None = None  # on MISMATCH
    noise_dominated: tuple[LeafDiff, ...] = ()
    errors: tuple[str, ...] = ()  # the whole text of what a twin raised; its record in done/twin is shortened
    unverified: Unmeasured | Hidden | Thin | None = None  # NOT VERIFIED: why (and kind then '')
    memory: dict | None = None  # bytes per device of one call: {'run': ..., 'twins': {twin: ...}} (footprint)
    location: Any = None  # locate.Location: where the first step parts (on MISMATCH, or asked for on MATCH)
    sensitivity: Any = None  # systematic.Sensitivity: on MATCH, how large a difference it could have missed

    @property
    def match(self) -> bool:
        return self.outcome is Outcome.MATCH

    @property
    def kind(self) -> str:
        """The diagnosis's ``Finding`` on MISMATCH, else ''."""
        return self.diagnosis.kind if self.diagnosis is not None else ''

    @property
    def hidden_by_noise(self) -> bool:
        """NOT VERIFIED because noise-dominated leaves are where a slip would hide."""
        return isinstance(self.unverified, Hidden)


def ulps(a: float, b: float) -> float:
    """|a - b| in float32 spacings of the larger magnitude."""
    return abs(a - b) / spacing32(max(abs(a), abs(b)) or 1.0)


def twin_refusal(nnx_losses: np.ndarray, twin_losses: np.ndarray, side: str = 'new') -> Refusal | None:
    """None when the twin computes what the ``side`` run (NNX, or legacy for a legacy twin) computes;
    else why it is refused as a floor."""
    for k in range(min(2, len(nnx_losses))):
        n, t = float(nnx_losses[k]), float(twin_losses[k])
        if not (np.isfinite(n) and np.isfinite(t)):
            return Refusal(Refusal.Why.NON_FINITE, k + 1, n, t, side=side)
        if ulps(n, t) > TWIN_ULPS:
            return Refusal(Refusal.Why.SPACINGS, k + 1, n, t, ulps(n, t), side=side)
    return None


def twin_reordered_nothing(nnx_final: compare.Neutral, twin_final: compare.Neutral) -> Refusal | None:
    """None unless the twin ended in bitwise the NNX run's state: then its gradients were summed in the same
    order (code pinned to its own mesh runs unchanged on a twin of as many devices: a hand-written tp
    ``shard_map``), and its floor of 0 would hold legacy to the ulp minimum. Asked only of a twin on
    as many devices as the checked run (tp's): on another count such code raises instead."""
    pairs = [
        (a, twin_final[g][p])
        for g, tree in nnx_final.items()
        for p, a in tree.items()
        if p in twin_final.get(g, {}) and compare.is_float(np.asarray(a).dtype)
    ]
    if pairs and all(np.array_equal(a, b) for a, b in pairs):
        return Refusal(Refusal.Why.SAME_ORDER)
    return None


def early_excess(
    legacy: dict, other: dict, nnx: dict, twin: dict, rule: FloorRule, fed: dict | None = None, start=None
) -> Excess | None:
    """None unless some parameter of ``other`` after the first call is already farther from the legacy
    run's (``legacy``) than the NNX twin allows the NNX run there (``rule``, per leaf, in its own
    precision: ``fed`` and ``start`` as for ``compare.compare_to_floor``); else which, by how much,
    against what. Chaos starts at rounding level and grows: a difference present from the first
    updates is not chaos. Asked of a legacy twin (it must not compute something else on another
    device count) and of the NNX run itself (a slip that shows early is never excused)."""
    for path, a in legacy.items():
        b, n, t = other.get(path), nnx.get(path), twin.get(path, nnx.get(path))
        if b is None or n is None or b.shape != a.shape or not compare.is_float(a.dtype):
            continue
        floor = float(np.abs(np.asarray(n, np.float64) - t).max(initial=0.0))
        moved = compare.moved_spacing(a, (fed or {}).get(path), (start or {}).get(path))
        limit = rule.limit(floor, float(np.abs(a.astype(np.float64)).max(initial=0.0)), a.dtype, moved)
        finite = bool(np.isfinite(b).all())
        spread = float(np.abs(np.asarray(a, np.float64) - b).max(initial=0.0)) if finite else np.inf
        if spread > limit:
            return Excess(path, spread, limit)
    return None


def not_verified(report: Report, output_layer: set[str]) -> Hidden | None:
    """None when the noise-dominated leaves leave the run verified; else why it is NOT VERIFIED (the report
    adds why they matter). ``output_layer``: the paths of the parameters of the layer the model applies last."""
    params = [leaf for leaf in report.leaves if leaf.group == 'params' and not leaf.one_sided]
    noisy = [leaf for leaf in params if leaf.noise_dominated]
    share = sum(leaf.size for leaf in noisy) / max(sum(leaf.size for leaf in params), 1)
    head = tuple(leaf for leaf in noisy if leaf.path in output_layer)
    losses = any(leaf.noise_dominated and leaf.group == 'losses' for leaf in report.leaves)
    over = share if share > NOT_VERIFIED_SHARE else None
    if over is None and not head and not losses:
        return None
    return Hidden(over, tuple(noisy), head, losses)


def first_step_tree(loss: float | None = None, grads: dict[str, np.ndarray] | None = None) -> compare.Neutral:
    """The first step's loss and gradients as leaves of their own group, ``first_step/...``."""
    tree = {'loss': np.asarray(loss, np.float32)} if loss is not None else {}
    return {'first_step': {**tree, **{f'grads/{k}': v for k, v in (grads or {}).items()}}}


def failed(report: Report, group: str | None = None) -> list[LeafDiff]:
    return [leaf for leaf in report.leaves if not leaf.ok and (group is None or leaf.group == group)]


EARLIER = ('forward', 'loss', 'backward', 'statistics')  # stages of a place found before the update
# Where-kinds (``location.Where``'s values) of a place that computing parts at, not drawing: the first step's
# records hold both sides' random draws equal, so a module there that computes otherwise is no randomness.
COMPUTED = ('module', 'between', 'loss', 'backward', 'statistics')


def diagnose(
    report: Report, nonfinite: NonFinite | None, rerun_matched: bool | None, grads_checked: bool,
    no_floor: NoTwin | None = None, placed: str | None = None, place: str | None = None,
) -> Diagnosis:  # fmt: skip
    """The ``Diagnosis`` of a report that does not match; the first finding that explains it wins.
    ``no_floor``: why no twin measured a floor (the verdict's ``twin``), for ``unmeasured``;
    ``placed``: the stage the location found (a ``Where``'s), which an ``update`` or ``optimizer`` reading of the
    final leaves must not contradict (a GroupNorm's epsilon read 'the update differs' above 'where: module'; behind
    diffusion_distillation's zero-initialised output convolutions every first gradient is 0 on both sides, and its
    slips in the forward pass read 'the optimizer ... differ'): it is ``math``, placed by the first step's records.
    ``place``: the location's kind (a ``Where`` value); a first loss that agrees only with dropout off is
    randomness unless the records place a computation (``COMPUTED``): a LayerNorm's epsilon then, not the masks."""
    bad = failed(report)
    if nonfinite is not None:
        return Diagnosis(Finding.NON_FINITE, nonfinite=nonfinite)
    sided = tuple(leaf for leaf in bad if leaf.one_sided)
    if sided and len(sided) == len(bad):
        return Diagnosis(Finding.BOOKKEEPING, sided=sided)
    early = tuple(failed(report, 'first_step'))
    if early and rerun_matched and place not in COMPUTED:
        return Diagnosis(Finding.RANDOMNESS, early, sided)
    if early:
        return Diagnosis(Finding.MATH, early, sided)
    later = tuple(leaf for leaf in bad if not leaf.one_sided)
    if report.floor is None:
        return Diagnosis(Finding.UNMEASURED, later, sided, no_floor=no_floor)
    if all(leaf.group == 'model_state' for leaf in later):
        return Diagnosis(Finding.STATE, later, sided)
    if all(leaf.group == 'ema' for leaf in later):
        return Diagnosis(Finding.EMA, later, sided)
    if all(leaf.group == 'metrics' for leaf in later):  # the losses, parameters and optimizer state agree
        return Diagnosis(Finding.METRICS, later, sided)
    if placed in EARLIER:  # what the final leaves show grew from a place the first step's records found
        return Diagnosis(Finding.MATH, later, sided, grads_checked=grads_checked, placed=placed)
    return Diagnosis(Finding.OPTIMIZER if grads_checked else Finding.UPDATE, later, sided, grads_checked=grads_checked)


def nonfinite(losses: dict[str, np.ndarray], finals: dict[str, compare.Neutral], data_step: int | None):
    """None when everything is finite; else where the first NaN or Inf appeared, per side (``NonFinite``)."""
    where = []
    for side, per_step in losses.items():
        steps = np.flatnonzero(~np.isfinite(per_step))
        leaves = [f'{g}/{p}' for g, tree in finals[side].items() for p, a in tree.items() if not _finite(a)]
        if len(steps):
            where.append((side, int(steps[0]) + 1, None))
        elif leaves:
            where.append((side, None, leaves[0]))
    return NonFinite(tuple(where), data_step) if where else None


def _finite(a: np.ndarray) -> bool:
    return not compare.is_float(a.dtype) or bool(np.isfinite(a).all())
