"""The plan of one check, resolved once from the flags (``RunConfig``) by the harness: each stage is handed its
part, never the whole config.

- ``Run``: what the two sides need: the check's shape (D devices, K steps a call, C calls, a global batch G), its
  seed and keys, the new side's placement and form, the precision it computes at, a deliberate perturbation.
  Every room that builds, traces, runs or re-runs a side takes this part (its twins as ``dataclasses.replace``
  of it).
- ``Judging``: what the verdict measures beyond the two runs: the verdict's mode, the twin that measures the
  floor, and whether the first step is located on a MATCH too.
- ``Plan``: the two, and what the harness alone reads: the reference a side is read from, the default-precision
  gap asked for.
"""

import dataclasses
from typing import Any


class Shape:
    """What follows from a check's shape, for ``Run`` and ``RunConfig`` alike (each holds ``mesh``, ``batch_size``,
    ``devices``, ``steps_per_call`` and ``calls``)."""

    @property
    def mesh_axes(self) -> dict[str, int] | None:
        return dict(self.mesh) if self.mesh else None

    @property
    def per_device_batch(self) -> int:
        return self.batch_size // self.devices

    @property
    def steps(self) -> int:
        return self.steps_per_call * self.calls


@dataclasses.dataclass(frozen=True)
class Run(Shape):
    """What the two sides need of a check (``RunConfig``'s fields of the same names)."""

    workload: str  # the port's name
    devices: int  # D: pmap replicas on the legacy side, mesh size on the new side
    steps_per_call: int  # K: steps fused into one compiled call
    calls: int  # C: compiled calls; K * C steps in all
    batch_size: int  # G: global batch, split evenly over the D devices
    seed: int  # one seed for the data, the initial parameters and every key
    rng_mode: str  # 'per-device' or 'global'
    perturb: float = 0.0  # the new side's learning rate * (1 + perturb): a deliberate mismatch
    strategy: str = 'dp'  # how the new side places its state
    mesh: tuple[tuple[str, int], ...] | None = None  # fsdp-tp's 2-D mesh
    nnx_form: str = 'split'  # the suite's NNX loop: over split state or over the objects
    precision: str = 'auto'  # matrix products' precision (an accelerator's; float32 on the CPU)


@dataclasses.dataclass(frozen=True)
class Judging:
    """What the verdict measures beyond the two runs (``RunConfig``'s fields of the same names)."""

    verdict: str = 'measured'  # measured: a twin's floor always; strict: + first gradients; screen: one if it fails
    twin: str = 'program'  # the floor's twin: the run's own program from nudged inputs, or other device counts
    locate: bool | None = None  # where the first step parts: None on MISMATCH, True on MATCH too, False never


@dataclasses.dataclass(frozen=True)
class Plan:
    run: Run
    judging: Judging
    reference: str | None = None  # the pmap side read from this recording, not run
    default_gap: bool = False  # on an accelerator at highest, both sides again at the default precision (said)

    @classmethod
    def of(cls, config: Any) -> 'Plan':
        """The plan of a validated ``RunConfig`` (``config.run``, ``config.judging``: its parts)."""
        return cls(config.run, config.judging, config.reference, config.default_gap)


def part(cls: type, config: Any):
    """``cls`` (``Run`` or ``Judging``) from ``config``'s fields of the same names."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})
