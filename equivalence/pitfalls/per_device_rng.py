"""Pitfall 3: per-device keys on one side, one global key on the other.

score_sde gives each pmap device its own key and draws noise for its own G/D examples;
natural sharded code draws once, with one key, for the global batch. Both are right,
but they are different random numbers, so the two trainings are not the same run and
no comparison of them can pass. The fix is to use one mode on both sides: the suite
implements both (``--rng per-device|global``, see docs/randomness.md), and either matches.
"""

import numpy as np

from equivalence.core import harness
from equivalence.core.compare import compare
from equivalence.core.compare.outcome import Outcome
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.run import sides
from equivalence.pitfalls.base import DAMAGE, CaseResult, yes

NUMBER = 3
NAME = 'per_device_rng'
TITLE = 'per-device RNG against a global key'
DESCRIPTION = (
    'The pmap side splits one key per device (score_sde), the sharded side draws the global batch from one key. '
    'Bites in every loss that draws noise (diffusion noise and times, dropout): other numbers, other training.'
)


def run(devices: int) -> CaseResult:
    wl = workloads.get('score')
    configs = {
        mode: RunConfig(workload='score', devices=devices, steps_per_call=5, calls=2, batch_size=128, rng_mode=mode)
        for mode in ('per-device', 'global')
    }
    prepared = harness.prepare(wl, configs['global'])  # the harness's own: its kind, pre-flight, inputs
    kind, fed = prepared.kind, prepared.inputs  # the same inputs for both modes
    legacy = {m: sides.run_legacy(kind, c, fed) for m, c in configs.items()}
    nnx = {m: sides.run_new(kind, c, fed) for m, c in configs.items()}
    reports = {
        (a, b): compare.compare(
            sides.with_losses(legacy[a].final, legacy[a].losses), sides.with_losses(nnx[b].final, nnx[b].losses)
        )
        for a, b in [('per-device', 'global'), ('per-device', 'per-device'), ('global', 'global')]
    }
    wrong = reports['per-device', 'global']
    first = float(np.abs(legacy['per-device'].losses[0] - nnx['global'].losses[0]))
    fixes = {f'{a}/{b}': r for (a, b), r in reports.items() if a == b}
    ok = {m: r.outcome is Outcome.MATCH for m, r in fixes.items()}  # each comparison's own outcome
    return CaseResult(
        symptom=f'legacy per-device vs NNX global: step-1 loss {first:.1e} apart, losses up to '
        f'{wrong.max_abs("losses"):.1e}, params {wrong.max_abs("params"):.1e} after {configs["global"].steps} steps',
        threshold=f'step-1 loss and parameter difference > {DAMAGE:g}',
        damage_shown=first > DAMAGE and wrong.max_abs('params') > DAMAGE,
        fix='same mode on both sides: '
        + ', '.join(
            f'{m} losses {r.max_abs("losses"):.1e} params {r.max_abs("params"):.1e} ok {yes(ok[m])}'
            for m, r in fixes.items()
        ),
        fix_matches=all(ok.values()),
        details={
            'wrong': {'first_step_loss_diff': first, **{g: wrong.max_abs(g) for g in ('losses', 'params', 'ema')}},
            **{m: {'match': ok[m], **{g: r.max_abs(g) for g in ('losses', 'params', 'ema')}} for m, r in fixes.items()},
        },
    )
