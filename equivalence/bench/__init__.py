"""The benchmark as a library: build the variants, time them interleaved, summarise.

``python -m equivalence.bench`` (``__main__``) parses flags and prints; ``variants`` builds the
timed calls, ``timing`` times them and reads their programs, ``report`` turns it into text and JSON.
"""

import dataclasses

K_SCALING = 20  # the fused K that the "fusing pays" target compares with one step per call
K_COMPILE = (5, 100)  # compile time must not grow with K: the scan stays a loop
POOL_K = max(K_SCALING, *K_COMPILE)  # the data pool holds C calls of the longest K a variant uses


def pool_steps(config) -> int:
    """Steps of data generated up front: ``calls`` calls of the longest K any variant takes."""
    return config.calls * max(config.steps_per_call, POOL_K)


def run(wl, config, repeats: int, compile_repeats: int, strategy_configs=(), k_scaling: int = K_SCALING):
    """Build every variant, check they agree, time compiles, warm up, then the interleaved repeats.

    ``strategy_configs``: the shipped NNX call is also timed under each config's strategy and
    form, beside the data-parallel variants and legacy pmap. ``k_scaling``: the long fused K timed beside
    K and one step per call (K itself: none beside it, as for a model whose step takes seconds)."""
    from equivalence.bench import plan, variants
    from equivalence.bench import report as benchreport
    from equivalence.bench import timing as measure
    from equivalence.core import harness, kinds
    from nnx_sharded import sharding

    sharding.take_fallbacks()  # what earlier calls traced is theirs
    kinds.of(wl).one_program_each('bench')
    for cfg in (config, *strategy_configs):
        harness.validate(wl, cfg)
    # the harness's own preparation: the pre-flight over the pool's steps, the inputs of one call, names paired once
    prepared = harness.prepare(wl, dataclasses.replace(config, calls=1), pool_steps(config))
    progress = measure.Progress(f'{config.workload} D={config.devices} K={config.steps_per_call}')
    machine = measure.machine()
    progress('building variants')
    feed = variants.Feed(prepared.kind, prepared.inputs, config.run, pool_steps(config))
    asked = plan.Plan(wl, config.run, feed, k_scaling, tuple(c.run for c in strategy_configs))
    built, not_built = prepared.kind.asked(asked)
    compiles = {}
    for v in built:
        progress(f'compile x{compile_repeats}: {v.label}')
        compiles[v.name] = measure.time_compile(v, v.steps_per_call, compile_repeats)
    scaling = compile_scaling(next(v for v in built if v.name == 'nnx'), compile_repeats, progress)
    first = {}
    for v in built:
        progress(f'first call and warm-up: {v.label}')
        first[v.name] = v.host_losses(v.call(v.place(1)[0]))
        measure.warm_up(v, 3)
    blocks = measure.interleaved(built, repeats, config.calls, progress)
    progress.done()
    machine['load_avg_1m_end'] = measure.machine()['load_avg_1m']
    result = benchreport.BenchResult(config, repeats, machine, built, blocks, compiles, scaling, first, not_built,
                                     k_scaling=k_scaling)  # fmt: skip
    result.placement = sharding.take_fallbacks()  # the shipped call's gradient all-reduce, where it fell back
    return result


def compile_scaling(v, repeats: int, progress) -> dict[int, 'object']:
    """The shipped call compiled at K=5 and K=100, alternately."""
    from equivalence.bench import timing as measure

    timings = {k: measure.CompileTiming([], {}) for k in K_COMPILE}
    for r in range(repeats):
        for k in K_COMPILE:
            progress(f'compile scaling {r + 1}/{repeats}: nnx shipped at K={k}')
            one = measure.time_compile(v, k, 1)
            timings[k] = dataclasses.replace(timings[k], seconds=timings[k].seconds + one.seconds, hlo=one.hlo)
    return timings
