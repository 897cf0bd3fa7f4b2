"""Pitfall 8: reading replica 0 back with ``x[0]`` (the old ``unreplicate``) on today's pmap outputs.

Since JAX 0.8 a pmap output is one global ``jax.Array`` sharded over the devices, not a
list of per-device buffers. ``x[0]`` is then an indexing op compiled for all D devices:
its program is an all-reduce (each device contributes its shard or zeros), and the
result is copied to every device. Reading device 0's shard
(``x.addressable_shards[0].data``, what ``legacy_pmap.train.unreplicate`` does) moves
nothing. Timings are medians, reported and never asserted; the structure (the all-reduce,
the D copies) is what the tests check.
"""

import statistics
import time
from collections.abc import Callable

import jax

from equivalence.core import harness
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.state import convert
from equivalence.pitfalls.base import CaseResult, max_abs_diff
from legacy_pmap import train as legacy

NUMBER = 8
NAME = 'unreplicate_gather'
TITLE = 'x[0] / unreplicate on the new pmap outputs'
DESCRIPTION = (
    'jax.tree.map(lambda x: x[0], pstate) to read the replicated state back after a pmap call. '
    'Bites every time state is read (logging, checkpoints, eval): '
    'each leaf is a compiled all-reduce, its result copied to all devices.'
)
REPEATS = 30


def median_seconds(read: Callable, tree, repeats: int = REPEATS) -> float:
    """Median wall time of one full read of ``tree``, after a first (compiling) read."""
    jax.block_until_ready(read(tree))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(read(tree))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def index_zero(tree):
    return jax.tree.map(lambda x: x[0], tree)


def all_reduces(x: jax.Array) -> int:
    """All-reduces in the program ``x[0]`` compiles to for an array of this shape and placement."""
    return jax.jit(lambda a: a[0]).lower(x).compile().as_text().count(' all-reduce(')


def per_kind(leaves: list[jax.Array]) -> list[jax.Array]:
    """One leaf per (shape, dtype): ``x[0]`` compiles once for each."""
    return list({(x.shape, x.dtype): x for x in leaves}.values())


def pmap_state(devices: int):
    """The suite's replicated train state after one real pmap(scan) call (mlp workload)."""
    wl = workloads.get('mlp')
    config = RunConfig(workload='mlp', devices=devices, steps_per_call=2, calls=1, batch_size=wl.default_batch)
    prepared = harness.prepare(wl, config)  # the harness's own: its kind, pre-flight, inputs
    fed = prepared.inputs
    calls, rng = fed.calls, fed.rng
    setup = prepared.kind.legacy_setup(config, fed)
    _, args = setup.call_args(rng, calls[0])
    (_, pstate), _ = setup.p_train_step(*args)
    return pstate


def run(devices: int) -> CaseResult:
    pstate = pmap_state(devices)
    leaves = jax.tree.leaves(pstate)
    wrong, fixed = index_zero(pstate), legacy.unreplicate(pstate)
    copies = {len(x.sharding.device_set) for x in jax.tree.leaves(wrong)}
    fixed_copies = {len(x.sharding.device_set) for x in jax.tree.leaves(fixed)}
    reduces = [all_reduces(x) for x in per_kind(leaves)]
    shard_reduces = [all_reduces(x.addressable_shards[0].data) for x in per_kind(leaves)]
    t_wrong, t_fixed = median_seconds(index_zero, pstate), median_seconds(legacy.unreplicate, pstate)
    diff = max_abs_diff(convert.flatten(wrong), convert.flatten(fixed))
    nbytes = sum(x.nbytes for x in leaves) // devices
    return CaseResult(
        symptom=f'{len(leaves)} leaves ({nbytes} B per replica): each x[0] is a compiled all-reduce over {devices} '
        f'devices, its result copied to all {max(copies)}; one full read {t_wrong * 1e3:.1f} ms vs '
        f'{t_fixed * 1e3:.1f} ms (median of {REPEATS}, {t_wrong / t_fixed:.0f}x)',
        threshold=f'every leaf: x[0] is an all-reduce whose result lives on all {devices} devices',
        damage_shown=min(reduces) >= 1 and copies == {devices},
        fix=f"legacy_pmap.train.unreplicate (device 0's shard): result on {max(fixed_copies)} device, "
        f'{max(shard_reduces)} all-reduces, same values (max |diff| {diff:.1e})',
        fix_matches=fixed_copies == {1} and max(shard_reduces) == 0 and diff == 0.0,
        details={
            'leaves': len(leaves),
            'bytes_per_replica': int(nbytes),
            'all_reduces_per_leaf': sorted(set(reduces)),
            'shard_read_all_reduces': sorted(set(shard_reduces)),
            'x0_device_copies': sorted(copies),
            'shard_read_device_copies': sorted(fixed_copies),
            'median_ms_x0': t_wrong * 1e3,
            'median_ms_shard_read': t_fixed * 1e3,
            'ratio': t_wrong / t_fixed,
            'max_abs_diff': diff,
        },
    )
