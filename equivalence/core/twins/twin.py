"""The twins: the run's own compiled program from inputs one spacing off (``--twin program``, the default in one
process: ``run.nudge``, ``own_program``), or, as follows, the NNX side run again, on the same data, keys and
initial state, on another mesh (``--twin devices``, and every process of a run of several).

Only the order of the float32 reductions changes. In per-device mode the NNX step draws
its noise by vmapping over the ``[D, 2]`` key array inside one global program
(``nnx_sharded/train.py: draw_noise``), so the key layout D does not have to be the mesh
size: a twin on D' devices given the same ``[D, 2]`` keys draws bitwise the same numbers.
In global mode the keys do not depend on D at all. So ``|nnx - twin|`` is, leaf by leaf,
what reordering the sums alone does to this port: its noise floor.

A dp or shard_map run's twin is unsharded data parallelism (``dp``, split form) on another count. A
sharded strategy's twins (fsdp, tp, fsdp-tp on D > 1, one process) are on the run's own D devices,
holding no more per device than the run (``Reordered``, ``CANDIDATES``, ``FIT``): a model that fits
only sharded has no room for a twin on one device. Each leaf gets the larger of two twins' floors
(``farthest``). What those twins were before, and why two (the candidates' data-parallel one on D
is the second of these):

- On 1 device (every D > 1): NNX on 8 devices against NNX on 1 reproduces the 4.95e-6 that the
  cnn workload's ``conv1/kernel`` differs by under dp (``--rng global --seed 3``); NNX on 2
  against 1 differs by 1.2e-7 and would miss it. The only twin of dp and shard_map, whose
  per-device sums are the pmap run's.
- Data parallel on D devices, the pmap run's split (fsdp, tp, fsdp-tp on D > 1; several processes): tp's mesh is
  all model axis and sums the batch as one device does, so the 1-device twin rounds like it.
  Measured (cnn, Adam eps 1e-8, global keys, seed 6): ``params/hidden/kernel`` of NNX tp on 8
  is 4.5e-8 from NNX on 1 but 7.3e-7 from legacy on 8 and from NNX dp on 8: with the 1-device
  twin alone, a false MISMATCH (16x its floor). Seed 9 the same for tp (12x) and fsdp-tp on 8
  (15x; its ``conv2/kernel`` is 3.5e-6 from NNX on 1, 4.0e-5 from legacy and NNX dp on 8).
  Neither twin alone serves fsdp everywhere: on seed 6 NNX fsdp on 8 is within 3e-8 of NNX dp
  on 8, where only the 1-device twin measures the 7.3e-7 it is from NNX on 1.
- D = 1: 2 devices, if the batch splits over them.

With several processes every process runs the same twins on its own devices
(``jax.local_devices()``; a twin needs no more of them than one process has), on the whole batch
(``global_calls``): no collective, so no process waits on another, and every process
judges by process 0's twin (``gather.from_process_0``), so all reach the same verdict (the
workers' exit codes must agree). A twin that raises in one process raises in all of them
(``gather.together``), before any process waits for it to be shared.
"""

import contextlib
import dataclasses

import jax
import numpy as np

from equivalence.core.compare import compare, rule
from equivalence.core.compare.findings import Refusal, TwinRefused, Unrun
from equivalence.core.measure import clock, footprint
from equivalence.core.port import blame
from equivalence.core.port.kind import Kind as PortKind
from equivalence.core.port.plan import Run
from equivalence.core.rng import draws
from equivalence.core.run import nudge, sides
from equivalence.core.run.inputs import Inputs
from equivalence.core.run.model_side import Reordered, TwinKind
from equivalence.core.run.nudge import DRAWS, Nudged
from equivalence.core.twins import fresh
from equivalence.distributed import gather


def twin_counts(config: Run, available: int) -> tuple[int, ...]:
    """The twins' device counts for a run on D devices: 1, and D as well for a sharded strategy;
    on D = 1, 2 if there are 2 and the batch splits; () when none fits."""
    if config.devices > 1:
        return (1,) if config.strategy in ('dp', 'shard_map') else (1, config.devices)
    return (2,) if available >= 2 and config.batch_size % 2 == 0 else ()


# A sharded strategy's twin candidates, in order: placements of the run's own devices, the batch rows
# interleaved, then data parallel on D (which rounds as the pmap run does). The first two that hold at
# most FIT times the run's bytes per device are run (wide under fsdp at D = 8: fsdp 1.00x, fsdp-tp 0.82x;
# under tp: fsdp-tp and fsdp); where only one fits, data parallel on D runs as the second all the same, its
# bytes said (cnn under fsdp: fsdp-tp 1.58x, dp 1.46x; wide under fsdp-tp: fsdp 1.22x, dp 5.84x), since
# the reordered placements alone measured too small a floor there (wide fsdp-tp, seed 0: a correct run
# 11x its floor). Not tp's own placement: its mesh has no data axis, and cnn ended bitwise equal (seed 6).
CANDIDATES = {'fsdp': ('fsdp', 'fsdp-tp', 'dp'), 'tp': ('fsdp-tp', 'dp', 'fsdp'), 'fsdp-tp': ('fsdp-tp', 'fsdp', 'dp')}
FIT = 1.1  # a sharded run's twin may hold at most this many times the run's bytes per device
TWINS = 2  # a sharded run's twins: each leaf the larger of their floors


def must_fit(config: Run) -> bool:
    """Whether the twins are a sharded strategy's candidates, each held to fit (fsdp, tp, fsdp-tp on
    D > 1, in one process: across processes each runs its twin on its own devices, ``twin_counts``)."""
    return config.devices > 1 and config.strategy in CANDIDATES and jax.process_count() == 1


def twin_kinds(config: Run, chosen: str, available: int) -> tuple[TwinKind, ...]:
    """The twins of a run: the run's own program from nudged inputs (``chosen``, ``--twin``, is 'program'; ``nudge``;
    one process), else a sharded strategy's ``CANDIDATES`` (the judge runs the first ``TWINS`` that fit), otherwise
    ``twin_counts``."""
    if chosen == 'program' and jax.process_count() == 1:
        return DRAWS  # several processes: each runs a device-count twin on its own devices, with no collective,
        # so that one process's failure is every process's (``gather.together``), with none left waiting in it
    if must_fit(config):
        return tuple(config.devices if s == 'dp' else Reordered(s) for s in CANDIDATES[config.strategy])
    return twin_counts(config, available)


def devices_of(kind: TwinKind, config: Run) -> int:
    """The devices a twin needs beyond the run's own: 0 for the run's own program."""
    if isinstance(kind, Nudged):
        return 0
    return config.devices if isinstance(kind, Reordered) else kind


def label(kind: TwinKind) -> str:
    """'8 device(s)' (data parallel), or 'fsdp, batch rows interleaved' (the run's devices, placed so)."""
    return str(kind) if isinstance(kind, Reordered | Nudged) else f'{kind} device(s)'


def describe(kinds: list[TwinKind]) -> str:
    """'on 1 device(s)', 'on 1 and 8 device(s)', or the run's devices and each twin's placement."""
    if all(isinstance(k, Nudged) for k in kinds):
        moved = ' and one of its batches alone' if any(not k.params for k in kinds) else ''
        return f"of the run's own program: one of its initial parameters and batches one spacing off{moved}"
    if all(isinstance(k, int) for k in kinds):
        return f'on {" and ".join(map(str, kinds))} device(s)'
    return "on the run's devices: " + ' and '.join(map(label, kinds))


def measuring(kind: TwinKind, tree: compare.Neutral) -> compare.Neutral:
    """The groups of a twin's tree that are a floor (``Nudged.measures``): every group but a twin's own nudge."""
    return {g: t for g, t in tree.items() if not isinstance(kind, Nudged) or kind.measures(g)}


PROGRAM_TWIN = describe(list(DRAWS))  # what a verdict says of its twins where they are the run's own program


def farthest(nnx: compare.Neutral, twins: list[compare.Neutral]) -> compare.Neutral:
    """One twin tree whose every leaf is the twin's farthest from the NNX run's: the floor
    ``max |nnx - twin|`` of each leaf is then the larger of the twins' floors."""
    out: compare.Neutral = {}
    for g, tree in nnx.items():
        for p, a in tree.items():
            have = [t[g][p] for t in twins if p in t.get(g, {}) and t[g][p].shape == a.shape]
            if have and compare.is_float(a.dtype):  # bfloat16 too, which numpy does not call floating
                diff = lambda b, a=a: float(np.abs(a.astype(np.float64) - b).max(initial=0.0))  # noqa: E731
                out.setdefault(g, {})[p] = max(have, key=diff)
    return out


def run_twin(
    kind: PortKind,
    config: Run,
    inputs: Inputs,
    n_twin: TwinKind,
    lr_scale=None,
    record: draws.FirstCall | None = None,
    setup=None,
    after_call=None,
    before_call=None,
    forward: bool = False,
    program=None,
):
    """The twin's ``PathResult``: its final state, per-step losses and parameters after each call, run on
    ``inputs.whole_calls`` (the whole batch); with ``inputs.restore(setup) -> rng`` (``--resume-at``) it
    loads the checkpoint the checked run resumed from onto the twin's mesh, and the calls follow it;
    ``record``, if given, keeps the random numbers its first call draws (the twin's setup, which draws
    initial values, before it). With several processes, every process's result is process 0's
    (``gather.from_process_0``), and an exception in one process's twin is raised in every process
    (``gather.together``): none waits for a twin that will never be shared. ``forward``: ``sides.run_calls``'
    (no bytes measured). ``program``: the run's compiled call, which a twin of the run's own program runs
    (``Nudged``: its calls nudged as its setup's initial parameters are)."""
    calls, rng = inputs.whole_calls, inputs.rng
    if isinstance(n_twin, Nudged):
        calls = [nudge.tree(c, n_twin.draw) for c in calls]
    setup = setup or gather.together(kind.twin_setup, config, inputs, n_twin, lr_scale)
    if isinstance(n_twin, Nudged):
        setup.shared(program)
    if inputs.restore is not None:
        rng = gather.together(inputs.restore, setup)

    def run():
        with draws.recording(record.log) if record else contextlib.nullcontext():
            after = record.after_call if record else after_call
            losses, per_call = sides.run_calls(setup, calls, rng, None, sides.silent, 'twin', after, before_call,
                                               forward)  # fmt: skip
        return setup.neutral(), losses, sides.loop_metrics(setup), per_call

    final, losses, metrics, per_call = gather.together(run)
    # every call's parameters too: the verdict reads their trends (``systematic``), the same in every process
    final, losses, metrics, per_call = gather.from_process_0((final, losses, metrics, per_call))
    result = sides.PathResult(final, losses, per_call, None, mesh=dict(setup.mesh.shape))
    result.metrics, result.memory = metrics, None if forward else footprint.per_device(setup, calls[0], rng)
    return result


# -- the twins a verdict runs ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measured:
    """The twins that measured a floor, and what became of the others."""

    twins: dict  # twin kind -> its PathResult: each ran and computed what the NNX run computes
    why: tuple  # why each other twin did not run (``findings.Unrun``) or was refused (``findings.TwinRefused``)
    fresh: tuple  # the twin kinds that ran in a fresh process
    errors: tuple[str, ...]  # the whole text of what a twin raised (the JSON report)


class TwinNotRun(Exception):
    """Why a twin did not run (``findings.Unrun``); ``errors``: the whole text of what it raised."""

    def __init__(self, unrun: Unrun, errors: tuple[str, ...] = ()):
        super().__init__(unrun)
        self.unrun, self.errors = unrun, errors


def measure(kind: PortKind, config: Run, new, inputs: Inputs, counts: tuple) -> Measured:
    """Each twin (up to ``TWINS``) that ran and computed what NNX computes, its losses and (a loop
    port's) random draws, and why each other did not run or was refused."""
    twins, why, fresh_ones, errors, drawn_by_run = {}, [], [], [], []
    fit = new.memory if must_fit(config) else None
    # Where fewer than two candidates fit, data parallel on D runs all the same (it rounds as the pmap run
    # does; the reordered placements alone measured too small a floor: wide under fsdp-tp, seed 0, 11x).
    tries = [(n, fit) for n in counts] + ([(config.devices, None)] if fit is not None else [])
    built: dict = {}  # a candidate's setup, compiled to read its bytes: the fallback runs it as it is
    for n, limit in tries:
        if len(twins) == TWINS or n in twins:
            continue
        if isinstance(n, Nudged):  # the run's own program: what it computes is the run's, by construction
            ran, refusal = own_program(kind, config, new, inputs, n)
            twins.update({n: ran} if ran is not None else {})
            why += [(n, refusal)] if refusal else []
            continue
        try:
            with clock.stage(f'twin {describe([n])}'):
                tw, drawn, in_fresh, raised = one_twin(kind, config, inputs, n, limit, built)
        except TwinNotRun as e:
            why.append((n, e.unrun))
            errors += e.errors
            continue
        errors += raised
        refusal = rule.twin_refusal(new.losses, tw.losses)
        if refusal is None and devices_of(n, config) == config.devices:
            refusal = rule.twin_reordered_nothing(new.final, tw.final)
        if refusal is None and drawn is not None:
            if not drawn_by_run:  # once, when a twin needs it
                with clock.stage("the run's first call again, its random draws recorded"):
                    drawn_by_run = [run_draws(kind, config, inputs)]
            said = draws.refusal(drawn_by_run[0], drawn)
            refusal = Refusal(Refusal.Why.DRAWS, detail=said) if said else None
        if refusal is not None:  # on another count, its losses or its draws: the likely cause said (words.PER_REPLICA)
            why.append((n, TwinRefused(n, refusal, in_fresh, isinstance(n, int) and n != config.devices)))
        else:
            twins[n] = tw
            fresh_ones += [n] if in_fresh else []
    kept = tuple(reason for n, reason in why if n not in twins)  # a fallback that ran: its bytes said
    return Measured(twins, kept, tuple(fresh_ones), tuple(errors))


def own_program(kind: PortKind, config: Run, new, inputs: Inputs, n: Nudged) -> tuple:
    """``(the PathResult of the run's own program from inputs nudged by ``n``, or None; why it measures
    nothing, or '')``: the same program, devices, keys and rows, so only a non-finite loss refuses it (its
    first losses move with its inputs: no loss is held to the run's within spacings)."""
    try:
        with clock.stage(f'twin of {n}'):
            tw = run_twin(kind, config, inputs, n, program=new.program)
    except Exception as e:  # noqa: BLE001 -- the port's own code raised on nudged inputs: no floor, said why
        return None, Unrun(n, blame.first_line(e), own=True)
    bad = [k for k, (a, b) in enumerate(zip(new.losses, tw.losses, strict=True)) if np.isfinite(a) != np.isfinite(b)]
    if bad:
        k = bad[0]
        return None, TwinRefused(n, Refusal(Refusal.Why.OWN_NON_FINITE, k + 1, new.losses[k], tw.losses[k]))
    return tw, ''


def one_twin(kind: PortKind, config: Run, inputs: Inputs, n, fit: dict | None = None, built=None):
    """``(the twin's PathResult, its first call's draws or None, whether it ran in a fresh process, what
    it raised here first)``: in this process when its devices suffice and the code runs there, else in a
    fresh process that sees ``n`` devices (code pinned to a mesh of its own, built from ``jax.devices()``);
    ``TwinNotRun`` saying why not. ``fit``: the run's bytes per device, which a candidate twin must not
    exceed ``FIT`` times; ``built``: setups built already, by twin (one that did not fit may run later as
    the fallback)."""
    calls, errors = inputs.whole_calls, []
    raised = None  # more devices than this process sees
    if devices_of(n, config) <= len(jax.local_devices()):
        drawn = draws_recorder(kind)
        try:
            built = {} if built is None else built
            setup = built[n] = built.get(n) or kind.twin_setup(config, inputs, n)
            too_big(setup, calls[0], inputs.rng, fit, n)
            tw = run_twin(kind, config, inputs, n, record=drawn, setup=setup)
            return tw, drawn and drawn.draws, False, ()
        except TwinNotRun:
            raise
        except Exception as e:  # noqa: BLE001 -- NNX code pinned to its own mesh cannot run on the twin's
            errors.append(f'twin on {n} device(s): {type(e).__name__}: {e}')
            raised = blame.first_line(e)
    cannot = fresh.why_not(config, inputs.restore is not None)
    if cannot:
        raise TwinNotRun(Unrun(n, raised, no_fresh=cannot), tuple(errors))
    try:
        tw, drawn = fresh.run_twin(kind, config, inputs, n, draws_recorder(kind) is not None)
    except Exception as e:  # noqa: BLE001 -- the fresh process failed too: both reasons
        errors.append(f'twin on {n} device(s) in a fresh process: {type(e).__name__}: {e}')
        raise TwinNotRun(Unrun(n, raised, fresh_raised=blame.first_line(e)), tuple(errors)) from None
    return tw, drawn, True, tuple(errors)


def too_big(setup, batch_KxG, rng, fit: dict | None, n) -> None:
    """``TwinNotRun`` when the twin would hold more than ``FIT`` times the run's bytes per device."""
    if fit is None:
        return
    held = footprint.per_device(setup, batch_KxG, rng)
    if held is not None and held['held'] > FIT * fit['held']:
        raise TwinNotRun(Unrun(n, ratio=held['held'] / fit['held']))


def draws_recorder(kind: PortKind) -> draws.FirstCall | None:
    """What records a twin's random draws, to check them against the run's, or None: where the port's step
    draws as its code says (``kind.draws_recorder``: a loop port's; a model port's are drawn by the suite
    from the run's keys, the same by construction), in one process (the run's first call is run again,
    recording, which across processes is collective)."""
    return kind.draws_recorder() if jax.process_count() == 1 else None


def run_draws(kind: PortKind, config: Run, inputs: Inputs) -> draws.Draws:
    """What the NNX run's first call draws: a fresh setup of it (restored from the checkpoint after
    ``--resume-at``), its first call run again while recording (``draws.first_call``)."""
    setup = kind.new_setup(config, inputs)
    rng = inputs.restore(setup) if inputs.restore is not None else inputs.rng
    return draws.first_call(setup, inputs.calls[0], rng)
