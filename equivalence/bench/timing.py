"""Timing for the benchmark: interleaved blocks of calls, compile time, and the machine.

Each call is timed twice: until it *returns* (dispatch: the host's work of tracing-cache
lookup, argument flattening and launch) and until its result is *ready* (the whole call).
Every call is blocked on before the next starts: on CPU, queueing many collective-bearing
calls can abort with an all-reduce rendezvous timeout, and one call in flight is what the
harness's training loop does too.
"""

import collections
import dataclasses
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax

from equivalence.bench.variants import Variant
from equivalence.explain import hlo

BACKEND_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'  # jax's own monitoring event


class CompileCounter:
    """Counts XLA compilations, so that a recompile inside a timed block is seen, not timed."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1


@dataclasses.dataclass
class Block:
    """One variant, one repeat: ``n`` calls back to back."""

    steps_per_s: float
    dispatch_ms: float  # median over the block's calls, until the call returned
    call_ms: float  # median over the block's calls, until its result was ready
    cpu_ms: float  # this process's CPU time per call (all threads), less sensitive to other processes' load
    compiles: int  # XLA compilations during the block; should be 0


def time_block(v: Variant, n_calls: int, counter: CompileCounter) -> Block:
    inputs = v.place(n_calls)  # keys and batches on the devices before the timer starts
    dispatch, total, before, cpu0 = [], [], counter.count, time.process_time()
    for args in inputs:
        t0 = time.perf_counter()
        loss = v.call(args)
        t1 = time.perf_counter()
        loss.block_until_ready()  # one execution: its outputs are ready together
        t2 = time.perf_counter()
        dispatch.append(t1 - t0)
        total.append(t2 - t0)
    cpu_ms = (time.process_time() - cpu0) / n_calls * 1e3
    steps_per_s = n_calls * v.steps_per_call / sum(total)
    med = statistics.median
    return Block(steps_per_s, med(dispatch) * 1e3, med(total) * 1e3, cpu_ms, counter.count - before)


def warm_up(v: Variant, n_calls: int) -> None:
    """Compile and settle: pmap recompiles once when its state first comes back as its own output."""
    for args in v.place(n_calls):
        v.call(args).block_until_ready()


def interleaved(variants: list[Variant], repeats: int, n_calls: int, progress: Callable) -> dict[str, list[Block]]:
    """A B C ... B C A ...: every variant runs once per repeat, so slow drifts of a shared
    machine's load hit all of them alike; the order rotates by one each repeat, so that no
    variant always runs first or always follows the same neighbour."""
    counter = CompileCounter()
    blocks: dict[str, list[Block]] = {v.name: [] for v in variants}
    for r in range(repeats):
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            progress(f'repeat {r + 1}/{repeats}: {v.label}')
            blocks[v.name].append(time_block(v, n_calls, counter))
    return blocks


COUNTED_OPS = ('copy', 'transpose', 'while', 'fusion')


def summarize(hlo_text: str) -> dict[str, int]:
    """What explains a speed difference between two compiled calls, from ``equivalence.explain.hlo``'s parse.

    All-reduce operands are counted apart by where they run: in the scan's loop (once per
    step) or outside it (once per call); on CPU each operand is one rendezvous of all
    devices. Op counts are instructions in the program text (fused computations included).
    """
    module = hlo.Module.parse(hlo_text)
    ops = collections.Counter(ins.op for ins in module.instrs.values())
    reduces = [c for c in hlo.module_collectives(module) if c.kind == 'all-reduce']
    return {
        'all_reduce': len(reduces),
        'all_reduce_operands_per_step': sum(len(c.operands) for c in reduces if c.loop_trips),
        'all_reduce_operands_per_call': sum(len(c.operands) for c in reduces if not c.loop_trips),
        'all_reduce_bytes': sum(c.bytes for c in reduces),
        'all_reduce_scalars_per_step': sum(_is_loss(o) for c in reduces if c.loop_trips for o in c.operands),
        **{op: ops[op] for op in COUNTED_OPS},
    }


def _is_loss(o: hlo.Operand) -> bool:
    """A forward-pass scalar all-reduced: a loss (or metric) averaged over the devices."""
    return o.role == 'forward' and hlo.dims(o.shape) == ()


def compiled_summary(compiled) -> dict[str, int]:
    """``summarize`` of a ``jax.stages.Compiled``, plus the bytes donation aliased."""
    memory = compiled.memory_analysis()
    field = lambda name: int(getattr(memory, f'{name}_size_in_bytes', 0) or 0) if memory is not None else 0  # noqa: E731
    per_device = {'argument_bytes': field('argument'), 'temp_bytes': field('temp')}  # the partitioned program's
    return {**summarize(compiled.as_text()), 'aliased_bytes': field('alias'), **per_device}


@dataclasses.dataclass
class CompileTiming:
    seconds: list[float]  # trace + lower + XLA compile of a fresh build, each repeat
    hlo: dict[str, int]  # what the last build compiled to (``compiled_summary``)


def time_compile(v: Variant, k: int, repeats: int) -> CompileTiming:
    """Lower and compile a freshly built call (new step closures: no tracing cache hit)."""
    seconds, compiled = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled = v.fresh_lowered(k).compile()
        seconds.append(time.perf_counter() - t0)
    return CompileTiming(seconds, compiled_summary(compiled))


def stats(values: list[float]) -> dict[str, float]:
    return {'median': statistics.median(values), 'min': min(values), 'max': max(values)}


def machine() -> dict:
    """Where the numbers came from: devices, cores, load and versions."""
    from equivalence.core.report.render import versions

    devices = jax.devices()
    return {
        'backend': jax.default_backend(),
        'device_kind': devices[0].device_kind,
        'devices_visible': len(devices),
        'simulated_cpu_devices': os.environ.get('JAX_NUM_CPU_DEVICES'),
        'cpu_cores': os.cpu_count(),
        'cpu_cores_usable': len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count(),
        'cpu_model': _cpu_model(),
        'load_avg_1m': os.getloadavg()[0],
        'versions': versions(),
    }


def _cpu_model() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            names = [line.split(':', 1)[1].strip() for line in f if line.startswith('model name')]
        return names[0] if names else platform.processor()
    except OSError:
        return platform.processor() or 'unknown'


class Progress:
    """One status line on stderr: rewritten in place on a terminal, one line per update otherwise."""

    def __init__(self, prefix: str):
        self.prefix, self.tty = prefix, sys.stderr.isatty()

    def __call__(self, message: str) -> None:
        line = f'[bench {self.prefix}] {message}'
        sys.stderr.write(f'\r\033[K{line}' if self.tty else f'{line}\n')
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty:
            sys.stderr.write('\r\033[K')
            sys.stderr.flush()
