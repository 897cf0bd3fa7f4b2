"""What XLA built for a fused call, counted from the compiled HLO text.

The numbers that explain a speed difference between the pmap and the sharded program:
how many all-reduces there are and how many bytes each moves (pmap ``pmean``s every
gradient leaf; the combiner may merge them), copies and transposes the layout forced,
whether the scan stayed a loop (``while``) and how many bytes the donation aliased.
"""

import collections
import re

_OP = re.compile(r'\s*(?:ROOT )?%\S+ = (.*?) ([a-z][\w-]*)\(')
_SHAPE = re.compile(r'\b(pred|[subf]\d+|bf16)\[([\d,]*)\]')
_BITS = {'pred': 8, 'bf16': 16}
COUNTED = ('all-reduce', 'all-reduce-start', 'all-gather', 'reduce-scatter', 'copy', 'transpose', 'while', 'fusion')


def _bytes(type_text: str) -> int:
    """Bytes of every array in an HLO result type, e.g. ``(f32[30]{0}, f32[20,30]{1,0})``."""
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        bits = _BITS.get(dtype) or int(dtype[1:])
        total += bits // 8 * _prod(dims)
    return total


def _prod(dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(',')):
        n *= int(d)
    return n


def summarize(hlo_text: str) -> dict[str, int]:
    """Op counts over every computation of the module, and the all-reduced bytes.

    Counts are of instructions in the program text, not executions: an all-reduce inside
    the scan's ``while`` body runs once per step.
    """
    ops, reduce_bytes = collections.Counter(), 0
    for line in hlo_text.splitlines():
        if m := _OP.match(line):
            ops[m.group(2)] += 1
            if m.group(2) in ('all-reduce', 'all-reduce-start'):
                reduce_bytes += _bytes(m.group(1))
    return {**{op.replace('-', '_'): ops[op] for op in COUNTED}, 'all_reduce_bytes': reduce_bytes}


def compiled_summary(compiled) -> dict[str, int]:
    """``summarize`` of a ``jax.stages.Compiled``, plus what donation aliased."""
    memory = compiled.memory_analysis()
    alias = int(getattr(memory, 'alias_size_in_bytes', 0) or 0) if memory is not None else 0
    return {**summarize(compiled.as_text()), 'aliased_bytes': alias}
