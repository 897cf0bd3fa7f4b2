"""``python -m equivalence.explain``: what XLA compiled for one fused call of each path.

It answers three questions from the compiled programs, not from the source: is the model
replicated on every device, does each device run the forward pass on its own slice of the
batch, and how are gradients combined when the NNX code has no ``pmean``. Nothing is
trained: each path's fused call is lowered and compiled once, then read.

Counting: a collective inside the scan's while loop runs K times per call; per step is
per call / K. Bytes are the payload each device puts in (operand sizes), per device.

The parts: ``measurements`` (what is measured, and the counting), ``placements`` (where each
input lives), ``memory`` (bytes per device, and a strategy's savings), ``measure`` (lowering
and reading each path's call), ``answers`` (the three answers), ``text`` (the report as JSON
and as text), ``pictures`` (sharding pictures); ``hlo`` reads the compiled HLO text.
"""

from equivalence.explain.answers import answer_gradients, answer_own_slice, answer_replicated, answers
from equivalence.explain.measure import measure, measure_both, measure_legacy, measure_nnx, measure_nnx_loop
from equivalence.explain.measurements import (
    COUNTING,
    QUESTIONS,
    PathMeasurement,
    Placement,
    bytes_per_step,
    gradient_operands,
    per_step,
    totals,
)
from equivalence.explain.memory import memory, state_bytes, strategy_dict, strategy_targets
from equivalence.explain.pictures import draw, picture_view, pictured
from equivalence.explain.placements import Layout, flat_inputs, key_name, placement
from equivalence.explain.text import (
    all_reduce_comparison,
    answers_text,
    header_text,
    path_text,
    report,
    strategy_text,
)

__all__ = [
    'COUNTING',
    'QUESTIONS',
    'Layout',
    'PathMeasurement',
    'Placement',
    'all_reduce_comparison',
    'answer_gradients',
    'answer_own_slice',
    'answer_replicated',
    'answers',
    'answers_text',
    'bytes_per_step',
    'draw',
    'flat_inputs',
    'gradient_operands',
    'header_text',
    'key_name',
    'measure',
    'measure_both',
    'measure_legacy',
    'measure_nnx',
    'measure_nnx_loop',
    'memory',
    'path_text',
    'per_step',
    'picture_view',
    'pictured',
    'placement',
    'report',
    'state_bytes',
    'strategy_dict',
    'strategy_targets',
    'strategy_text',
    'totals',
]
