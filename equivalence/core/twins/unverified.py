"""NOT VERIFIED: the runs whose leaves all compare and whose comparison still proves nothing, and what
they are judged by (the output layer, the parameters both runs started from).

Two ways (docs/verdict.md, not verified): no twin measured this port's floor, where the floor would
decide (``unmeasured``), or the noise-dominated leaves are where a slip would hide (``unverified``:
``rule.not_verified``).
"""

import dataclasses

import flax.linen as nn
import jax
import numpy as np

from equivalence.core.compare import compare, rule
from equivalence.core.compare.findings import Finding, Thin, Unmeasured
from equivalence.core.compare.outcome import Outcome
from equivalence.core.compare.rule import Verdict
from equivalence.core.port.ports import Port, init_inputs
from equivalence.core.run.inputs import Inputs
from equivalence.core.state import convert


def unmeasured(report: compare.Report, judged: Verdict) -> Verdict:
    """A run whose noise floor no twin could measure (none fits, each raised or was refused; not the
    user's ``--verdict screen``) is NOT VERIFIED where the floor would decide: a pass of the fixed screen,
    which is no measure of this port's own noise, or a failure of it that nothing tells from noise. A
    MISMATCH decided without a floor (the first step, the bookkeeping, NaNs) stays a MISMATCH."""
    if judged.match:
        why = Unmeasured(judged.twin, screen_passed=True)
    elif judged.kind == Finding.UNMEASURED:
        why = Unmeasured(judged.twin, screen_passed=False, failed=tuple(rule.failed(report)))
    else:
        return judged
    return dataclasses.replace(judged, outcome=Outcome.NOT_VERIFIED, diagnosis=None, unverified=why)


def unverified(port: Port, inputs: Inputs, report: compare.Report, judged: Verdict) -> Verdict:
    """A MATCH whose noise-dominated leaves are where a slip would hide made NOT VERIFIED
    (``rule.not_verified``); any other verdict as it is."""
    if not judged.match:
        return judged
    last = inputs.recorded.output_layer if inputs.recorded is not None else None  # a reference's, recorded
    why = rule.not_verified(report, last or output_layer(port, inputs.variables, inputs.calls[0], inputs.mapping))
    if why is None:
        return judged
    return dataclasses.replace(judged, outcome=Outcome.NOT_VERIFIED, unverified=why)


def thin(judged: Verdict, reading) -> Verdict:
    """A MATCH some of whose leaves grow every call as a slip in the update would, but too weakly to decide
    (``systematic.Reading.suggestive``), made NOT VERIFIED: thin evidence is never a MATCH."""
    if not judged.match or not reading.suggestive:
        return judged
    why = Thin(reading.suggestive, reading.steps, reading.steps_to_decide())
    return dataclasses.replace(judged, outcome=Outcome.NOT_VERIFIED, unverified=why)


def output_layer(port: Port, variables: dict, batch_KxG, mapping: dict) -> set[str]:
    """The paths, as compared (NNX's), of the parameters of the layer the model applies last: the last
    linen module to be called, in an abstract ``init`` on one example of ``batch_KxG``, that holds
    parameters of its own (``head``, ``Dense_1``). Call order, not the order of the variables: a
    pytree operation sorts dict keys."""
    entered: list[str] = []

    def record(next_fun, args, kwargs, context):
        if context.method_name == '__call__':
            entered.append('/'.join(context.module.path))
        return next_fun(*args, **kwargs)

    example = jax.tree.map(lambda v: v[0, :1], batch_KxG)
    key = jax.random.PRNGKey(0)
    args, kwargs = init_inputs(port, example)
    with nn.intercept_methods(record):
        jax.eval_shape(lambda: port.legacy_model().init({'params': key, 'dropout': key}, *args, **kwargs))
    paths = list(convert.flatten(variables.get('params', {})))
    owner = lambda p: p.rpartition('/')[0]  # noqa: E731
    last = next((m for m in reversed(entered) if any(owner(p) == m for p in paths)), None)
    return {mapping.get(p, p) for p in paths if owner(p) == last}


def start_params(variables: dict, mapping: dict) -> dict[str, np.ndarray]:
    """The parameters both runs started from, named as the comparison names them (NNX's paths)."""
    start = {'params': convert.flatten(variables.get('params', {}))}
    return (convert.rename(start, mapping) if mapping else start)['params']
