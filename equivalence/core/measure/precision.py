"""The precision a check computes in, and the device it runs on, said in the report (``Device``).

At JAX's default precision an accelerator does not compute float32 matrix products and convolutions in
float32: a TPU rounds their inputs to bfloat16 and sums a few bfloat16 passes, a GPU from Ampere on uses
TF32. The pmap program and the jit program fuse differently, so the same module rounds otherwise on each
side (a correct score_sde port's convolution 1.62e-04 apart on a TPU v5e where float32 allows 2e-06), and
a one-spacing float32 nudge either vanishes in that rounding or is amplified ~230,000-fold: no floor
measures it (``../shared/FACTS.md``, "The same idea on the TPU chip"). So on an accelerator a check runs
both sides, the twins and every recording at ``highest`` (``--precision auto``, the default), where the
two sides agree as on a CPU and the run's own program measures a floor; the report says so, and says how
far apart the two sides end when run again at the backend's default precision (``default_gap``), a
figure that is not judged. The CPU computes float32 in float32 at every setting: nothing changes there.
"""

import contextlib
import dataclasses

import jax
import numpy as np

DEFAULT_ROUNDING = {  # what a backend's default precision does to float32 matrix products
    'cpu': 'float32',
    'tpu': 'bfloat16 passes',
    'gpu': 'TF32 on Ampere and later',
    'cuda': 'TF32 on Ampere and later',
    'rocm': 'reduced precision on some GPUs',
}


def resolved(precision: str, backend: str | None = None) -> str:
    """``highest`` or ``default``: ``auto`` is ``highest`` on an accelerator, ``default`` on the CPU."""
    if precision != 'auto':
        return precision
    return 'default' if (backend or jax.default_backend()) == 'cpu' else 'highest'


@contextlib.contextmanager
def computing_at(precision: str):
    """Everything traced inside at ``precision`` (``highest``: ``jax.default_matmul_precision``)."""
    if resolved(precision) == 'highest':
        with jax.default_matmul_precision('highest'):
            yield
    else:
        yield


@dataclasses.dataclass(frozen=True)
class Device:
    """Where a check ran and in what precision: the report's header and its JSON ``device``."""

    backend: str  # jax.default_backend(): cpu, tpu, gpu
    kind: str  # the first device's device_kind ('TPU v5 lite', 'cpu')
    count: int  # the devices the run used
    precision: str  # the matrix products' precision the check computed at: 'highest' or 'default'
    default_rounding: str  # what the backend's default precision does to float32 products
    default_gap: dict | None = None  # the two sides run again at the default precision: max |diff| per group

    @classmethod
    def here(cls, devices: int, precision: str) -> 'Device':
        backend = jax.default_backend()
        kind = getattr(jax.devices()[0], 'device_kind', backend)
        return cls(backend, kind, devices, resolved(precision, backend), DEFAULT_ROUNDING.get(backend, 'unknown'))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def gap(old, new) -> dict:
    """Max |new - legacy| of two bare runs' losses and parameters (``sides.PathResult``s)."""
    params = [float(np.max(np.abs(np.asarray(new.final['params'][p], np.float64) - np.asarray(a, np.float64))))
              for p, a in old.final['params'].items() if p in new.final['params']]  # fmt: skip
    losses = np.abs(np.asarray(new.losses, np.float64) - np.asarray(old.losses, np.float64))
    return {'losses': float(losses.max(initial=0.0)), 'first_loss': float(losses[0]) if losses.size else 0.0,
            'params': max(params, default=0.0)}  # fmt: skip
