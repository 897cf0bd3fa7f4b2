"""Hints the report adds when a mismatch has the signature of a known pitfall.

A padded batch (a ``mask`` or ``weight`` leaf, or integer tokens with padding zeros) whose very
first loss already differs, on more than one device, is the signature of the masked-loss pitfall:
the pmap step's per-device weighted mean, then ``pmean``, weighs every *device* equally, and the
step-1 loss is computed before any update, so no optimizer or parameter slip can move it.
"""

from typing import Any

import numpy as np

from equivalence.core import compare, convert

PITFALL = 'masked_loss'
WEIGHT_WORDS = ('mask', 'weight', 'pad')


def padded(batch_KxG: Any) -> bool:
    """A leaf named for a mask or weights, or integer tokens holding padding zeros."""
    for path, a in convert.flatten(batch_KxG).items():
        if any(word in path.lower() for word in WEIGHT_WORDS) or (np.issubdtype(a.dtype, np.integer) and a.ndim > 2
                                                                  and (a == 0).any()):  # fmt: skip
            return True
    return False


def masked_loss(devices: int, batch_KxG: Any, report: compare.Report, legacy_losses, nnx_losses) -> list[str]:
    """The masked-loss pitfall's line, when a padded port's step-1 loss differs at D > 1."""
    tol = report.tolerance
    first = abs(float(legacy_losses[0]) - float(nnx_losses[0]))
    if report.match or devices == 1 or first <= tol.atol + tol.rtol * abs(float(legacy_losses[0])):
        return []
    if not padded(batch_KxG):
        return []
    return [
        f'hint: the step-1 loss differs ({first:.1e}) on a padded batch at {devices} devices: the masked-loss '
        'pitfall (a per-device weighted mean, then pmean, weighs devices, not tokens); see '
        f'python -m equivalence.pitfalls --only {PITFALL} (equivalence/pitfalls/{PITFALL}.py): psum the sums '
        "and the weights, or at level 1 return {'loss': sums_B, 'weight': weights_B}"
    ]
