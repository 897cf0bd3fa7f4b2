"""Advice for a loop port's own NNX call: one line per difference found, each backed by figures
measured in the same run (the medians of the timed blocks, the counts of the compiled programs).

Every figure is kept with where it came from (variant and field), so that the JSON report can be
checked against itself: a line of advice says nothing that this run did not measure.
"""

import dataclasses

from equivalence.bench.result import BenchResult, rate

GUIDE = 'docs/fast.md'


@dataclasses.dataclass(frozen=True)
class Figure:
    variant: str  # the variant's name in the report
    source: str  # 'timed' (median over repeats), 'program' (its compiled program), 'facts' (its first call)
    field: str  # e.g. 'dispatch_ms', 'transpose', 'donated_arrays': the key under that source in the JSON
    value: float


@dataclasses.dataclass(frozen=True)
class Finding:
    name: str
    text: str
    figures: tuple[Figure, ...]

    def to_json(self) -> dict:
        return {'name': self.name, 'text': self.text, 'figures': [dataclasses.asdict(f) for f in self.figures]}


def _timed(r: BenchResult, variant: str, field: str) -> Figure:
    return Figure(variant, 'timed', field, r.median(variant, field))


def _program(r: BenchResult, variant: str, field: str) -> Figure:
    return Figure(variant, 'program', field, r.compiles[variant].hlo[field])


def _facts(r: BenchResult, variant: str, field: str) -> Figure:
    return Figure(variant, 'facts', field, next(v.facts[field] for v in r.variants if v.name == variant))


def _state_kind(r: BenchResult) -> str:
    return next(v.facts.get('state_kind', '') for v in r.variants if v.name == 'nnx')


def graph_walk(r: BenchResult) -> Finding | None:
    own, jit = _timed(r, 'nnx', 'dispatch_ms'), _timed(r, 'nnx_jit_state', 'dispatch_ms')
    if _state_kind(r) != 'objects' or round(own.value - jit.value, 2) <= 0:  # as printed: 0.00 is no finding
        return None
    return Finding(
        'graph_walk',
        f'your call walks the object graph on every call: {own.value - jit.value:.2f} ms of its '
        f'{own.value:.2f} ms dispatch (the same call under jax.jit over its split state: {jit.value:.2f} ms); '
        f'nnx.split once and jax.jit over the state: see {GUIDE}#graph-mode',
        (own, jit),
    )


def state_pytree(r: BenchResult) -> Finding | None:
    state, pure = _timed(r, 'nnx_jit_state', 'dispatch_ms'), _timed(r, 'nnx_jit_dict', 'dispatch_ms')
    if _state_kind(r) == 'pytree' or round(state.value - pure.value, 2) <= 0:  # a pytree: split by the team
        return None
    return Finding(
        'state_pytree',
        f'an nnx.State carried between calls is flattened and rebuilt in Python: {state.value - pure.value:.2f} ms '
        f'of {state.value:.2f} ms dispatch against {pure.value:.2f} ms for a plain dict (nnx.to_pure_dict), '
        f'donated: see {GUIDE}#plain-dict',
        (state, pure),
    )


def donation(r: BenchResult) -> Finding | None:
    donated, arrays = _facts(r, 'nnx', 'donated_arrays'), _facts(r, 'nnx', 'state_arrays')
    kept, shipped = _program(r, 'nnx_jit_state', 'copy'), _program(r, 'nnx_jit_dict', 'copy')
    if donated.value >= arrays.value or kept.value <= shipped.value:
        return None
    return Finding(
        'donation',
        f'your call donates {donated.value:.0f} of its {arrays.value:.0f} state arrays, so XLA copies the state: '
        f'{kept.value:.0f} copies in its program against {shipped.value:.0f} with the state donated; '
        f'jax.jit(..., donate_argnums=0): see {GUIDE}#donation',
        (donated, arrays, kept, shipped),
    )


def loss_per_step(r: BenchResult) -> Finding | None:
    scalars = _program(r, 'nnx', 'all_reduce_scalars_per_step')
    arrays = _program(r, 'nnx', 'all_reduce_operands_per_step')
    if not scalars.value:
        return None
    return Finding(
        'loss_per_step',
        f'your step all-reduces {scalars.value:.0f} scalar(s) in every step (a loss averaged per step): '
        f'{scalars.value:.0f} of its {arrays.value:.0f} all-reduced arrays per step, each one rendezvous of all '
        f'devices on CPU; return per-example losses and average them after the scan: see {GUIDE}#loss-after-the-scan',
        (scalars, arrays),
    )


def transposes(r: BenchResult) -> Finding | None:
    own, pmap = _program(r, 'nnx', 'transpose'), _program(r, 'legacy', 'transpose')
    reduced = _program(r, 'nnx', 'all_reduce_operands_per_step')
    if own.value <= pmap.value or not reduced.value:  # nothing all-reduced (one device): not this cause
        return None
    return Finding(
        'transposes',
        f"your program has {own.value:.0f} transposes, pmap's {pmap.value:.0f}, and all-reduces {reduced.value:.0f} "
        'arrays every step: its gradient is all-reduced before '
        'the kernel transposes, which then run as copies every step; place the kernels reduced over the data axis '
        f'while the gradient is formed (nnx_sharded/sharding.py value_and_grad): see {GUIDE}#gradient-all-reduce',
        (own, pmap, reduced),
    )


def summary(r: BenchResult) -> Finding | None:
    legacy, own, shipped = (_timed(r, v, 'steps_per_s') for v in ('legacy', 'nnx', 'nnx_jit_dict'))
    return Finding(
        'summary',
        f"rewrapped in the shipped form your call ran at {shipped.value / legacy.value:.2f}x pmap's steps/s "
        f'({rate(shipped.value)} against {rate(legacy.value)}), as written at {own.value / legacy.value:.2f}x '
        f'({rate(own.value)}); the differences inside your step above are not in that figure',
        (legacy, own, shipped),
    )


CHECKS = (graph_walk, state_pytree, donation, loss_per_step, transposes, summary)
NEEDS = {  # the variants a check reads; a check whose variants did not run is skipped
    graph_walk: ('nnx', 'nnx_jit_state'),
    state_pytree: ('nnx_jit_state', 'nnx_jit_dict'),
    donation: ('nnx', 'nnx_jit_state', 'nnx_jit_dict'),
    loss_per_step: ('nnx',),
    transposes: ('nnx', 'legacy'),
    summary: ('legacy', 'nnx', 'nnx_jit_dict'),
}


def findings(r: BenchResult) -> list[Finding]:
    """Every finding whose variants ran and whose difference this run measured (none on a model port)."""
    if not r.notes:  # a model port: the suite's own loop, nothing to advise
        return []
    ran = {v.name for v in r.variants}
    found = [check(r) for check in CHECKS if set(NEEDS[check]) <= ran]
    return [f for f in found if f is not None]


def rows(r: BenchResult) -> list[str]:
    found = findings(r)
    if not found and not r.notes:
        return []
    out = ['advice for your NNX call (every figure measured in this run):']
    out += [f'  - {f.text}' for f in found]
    return out + [f'  ({note})' for note in r.notes]
