"""What XLA built for a fused call, counted from the compiled HLO text.

The numbers that explain a speed difference between the pmap and the sharded program:
how many all-reduces there are, their operands and bytes (pmap ``pmean``s every gradient
leaf; XLA's combiner merges them into one all-reduce of many operands, and on CPU each
operand is one rendezvous of all devices), copies and transposes the layout forced,
whether the scan stayed a loop (``while``) and how many bytes the donation aliased.
"""

import collections
import re

_OP = re.compile(r'\s*(?:ROOT )?%\S+ = (.*?) ([a-z][\w-]*)\(')
_SHAPE = re.compile(r'\b(pred|[subf]\d+|bf16)\[([\d,]*)\]')
_BITS = {'pred': 8, 'bf16': 16}
_COMPUTATION = re.compile(r'^(?:ENTRY )?%(\S+) .*\{\s*$')
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


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """Instruction lines of each computation, by name (``%name (...) -> ... {`` to ``}``)."""
    out, name = {}, None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            name = m.group(1)
            out[name] = []
        elif line.startswith('}'):
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def summarize(hlo_text: str) -> dict[str, int]:
    """Op counts over every computation of the module, and what the all-reduces move.

    Counts are of instructions in the program text, not executions. All-reduce operands
    are split by where they sit: in a ``while`` body (the scan's: run once per step) or
    outside any loop (run once per call).
    """
    bodies = set(re.findall(r'body=%([\w.\-]+)', hlo_text))
    ops, reduce_bytes, in_loop, per_call = collections.Counter(), 0, 0, 0
    for name, lines in _computations(hlo_text).items():
        for line in lines:
            if not (m := _OP.match(line)):
                continue
            ops[m.group(2)] += 1
            if m.group(2) in ('all-reduce', 'all-reduce-start'):
                reduce_bytes += _bytes(m.group(1))
                n = len(_SHAPE.findall(m.group(1)))
                in_loop, per_call = (in_loop + n, per_call) if name in bodies else (in_loop, per_call + n)
    counts = {op.replace('-', '_'): ops[op] for op in COUNTED}
    operands = {'all_reduce_operands_per_step': in_loop, 'all_reduce_operands_per_call': per_call}
    return {**counts, **operands, 'all_reduce_bytes': reduce_bytes}


def compiled_summary(compiled) -> dict[str, int]:
    """``summarize`` of a ``jax.stages.Compiled``, plus what donation aliased."""
    memory = compiled.memory_analysis()
    alias = int(getattr(memory, 'alias_size_in_bytes', 0) or 0) if memory is not None else 0
    return {**summarize(compiled.as_text()), 'aliased_bytes': alias}
