"""A port's declared tolerance: the fixed screen a comparison starts from, with the reason for it."""

import dataclasses

import ml_dtypes


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float  # per element: |nnx - legacy| <= atol + rtol * |legacy|
    atol: float
    reason: str


# The pmap loss is a mean of per-device means, the sharded loss one global mean; their
# gradients are summed in different orders, so they differ in the last bits (float32
# eps = 1.2e-7), and Adam's normalised steps carry that rounding into every parameter.
FLOAT32_REDUCTION_ORDER = Tolerance(
    rtol=1e-5,
    atol=1e-6,
    reason='float32 reduction order: pmean of per-device means vs one global mean',
)


def is_float(dtype) -> bool:
    """Whether leaves of ``dtype`` are floats: numpy's, and ml_dtypes' (bfloat16, float8), which
    numpy does not call floating; every other leaf is a counter, equal or wrong."""
    try:
        return ml_dtypes.finfo(dtype).dtype.kind in 'fV'  # V: ml_dtypes' own
    except (ValueError, TypeError):
        return False
