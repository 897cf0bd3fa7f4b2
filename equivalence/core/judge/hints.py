"""Hints the report adds when a mismatch has the signature of a known pitfall.

A padded batch (a ``mask`` or ``weight`` leaf, or integer tokens with padding zeros) that
mismatches on several devices and matches on one is the signature of the masked-loss pitfall:
the pmap step's per-device weighted mean, then ``pmean``, weighs every *device* equally, which
on one device is the global mean.
"""

from collections.abc import Callable
from typing import Any

import numpy as np

from equivalence.core.compare.outcome import Outcome
from equivalence.core.state import convert

PITFALL = 'masked_loss'
WEIGHT_WORDS = ('mask', 'weight', 'pad')


def padded(batch_KxG: Any) -> bool:
    """A leaf named for a mask or weights, or integer tokens holding padding zeros (``[K, G, length]``: not
    integer images, ``[K, G, H, W, C]`` of uint8 with black pixels, whose every MISMATCH ran both sides again
    on one device for nothing: 20 to 40 s a slip of google-research/vdm's port, tried blind)."""
    for path, a in convert.flatten(batch_KxG).items():
        if any(word in path.lower() for word in WEIGHT_WORDS) or (np.issubdtype(a.dtype, np.integer) and a.ndim == 3
                                                                  and (a == 0).any()):  # fmt: skip
            return True
    return False


def uneven(batch_KxG: Any, devices: int) -> bool:
    """Whether the devices' rows hold other amounts of weight on some step (a mask's or weights' sum, or the
    tokens that are not padding): only then can a mean of per-device means differ from the global mean. An
    lm1b port tried blind, every row 13 tokens and 3 pads, ran both sides again on every MISMATCH for it."""
    for path, a in convert.flatten(batch_KxG).items():
        named = any(word in path.lower() for word in WEIGHT_WORDS)
        if not named and not (np.issubdtype(a.dtype, np.integer) and a.ndim == 3):
            continue
        w = np.asarray(a, np.float64) if named else (np.asarray(a) != 0).astype(np.float64)
        k, g = w.shape[:2]
        if g % devices == 0:
            per_device = w.reshape(k, devices, -1).sum(axis=2)
            if not np.all(per_device == per_device[:, :1]):
                return True
    return False


def masked_loss(devices: int, calls: list, outcome: Outcome, matches_on_one: Callable[[], bool]) -> list[str]:
    """The masked-loss pitfall's line, when a padded port whose devices hold other amounts of weight on some
    call (``uneven``) mismatches at D > 1 and matches on one device (``matches_on_one`` runs both sides again
    on 1 device: only on this failure path)."""
    if outcome is not Outcome.MISMATCH or devices == 1 or not padded(calls[0]):
        return []
    if not any(uneven(batch_KxG, devices) for batch_KxG in calls) or not matches_on_one():
        return []
    return [
        f'hint: on a padded batch this port mismatches at {devices} devices and matches on 1: the masked-loss '
        'pitfall (a per-device weighted mean, then pmean, weighs devices, not tokens); see '
        f'python -m equivalence.pitfalls --only {PITFALL} (equivalence/pitfalls/{PITFALL}.py): psum the sums '
        "and the weights, or at level 1 return {'loss': sums_B, 'weight': weights_B}"
    ]
