"""Ports that keep state in their own precision, and the last known wrong verdict (issues 26, 29).

- SGD with momentum kept in bfloat16 (optax ``accumulator_dtype``, as the Vision Transformer
  code that issue 29 tried hard-codes): a one-unit flip of a bfloat16 moment is a 2^-8 relative
  change that enters the parameters at once. Correct ports must MATCH, judged in that precision
  (docs/verdict.md, precision), and a 1% learning-rate slip, far outside what bfloat16 rounding
  moves, must MISMATCH.
- ``cnn`` with Adam eps 1e-8 and per-device keys (dropout drawn per device, as score_sde does):
  chaos on the pmap side, seed 5 at D = 8, was a false MISMATCH until the legacy twin drew what
  the run drew with per-device keys (docs/verdict.md, the legacy twin).
"""

import dataclasses

import jax.numpy as jnp
import optax

from equivalence.core.port import workloads
from equivalence.corpus.builtin import CNN_EPS_1E8
from equivalence.corpus.entry import Entry


def sgd_bf16(lr: float):
    """SGD, momentum 0.9 accumulated in bfloat16; ``lr_scale`` is the suite's ``--perturb``."""
    return lambda lr_scale=1.0: optax.sgd(lr * lr_scale, momentum=0.9, accumulator_dtype=jnp.bfloat16)


MLP_BF16 = dataclasses.replace(
    workloads.WORKLOADS['mlp'], name='mlp-bf16-momentum', make_tx=sgd_bf16(1e-2),
    summary='regression MLP 20->30->1, L2 loss, SGD momentum 0.9 in bfloat16',
)  # fmt: skip
CNN_BF16 = dataclasses.replace(
    workloads.WORKLOADS['cnn'], name='cnn-bf16-momentum', make_tx=sgd_bf16(3e-2),
    summary='conv classifier with BatchNorm and Dropout on scikit-learn digits, SGD momentum 0.9 in bfloat16',
)  # fmt: skip

PER_DEVICE = {'rng_mode': 'per-device'}
ENTRIES = [
    Entry('mlp-bf16-momentum', 'correct', MLP_BF16, 'mlp, SGD momentum kept in bfloat16'),
    Entry(
        'mlp-bf16-lr-1e-2',
        'slip',
        MLP_BF16,
        'mlp, SGD momentum in bfloat16, NNX learning rate x (1 + 1e-2)',
        kind='optimizer',
        flags={'perturb': 1e-2},
    ),
    Entry('cnn-bf16-momentum', 'correct', CNN_BF16, 'cnn (BatchNorm, dropout), SGD momentum kept in bfloat16'),
    Entry(
        'cnn-eps-1e-8-per-device',
        'correct',
        CNN_EPS_1E8,
        'cnn, Adam eps 1e-8, per-device keys: chaos on the pmap side (seed 5 at D=8 was a false MISMATCH)',
        flags=PER_DEVICE,
        devices=(8,),
        min_seeds=6,
    ),
]
