"""The twin of the run's own compiled program (``Nudged``): the new side run again, on the run's devices,
in the run's process, with the program it already compiled, from inputs moved by one spacing of their
own precision: every float of linen's initial parameters and of every batch, each one step up or down
(``nudged``). Keys, integer data and the rows each device holds stay as they were, so every random draw
meets the same row. ``|new - nudged|`` is, leaf by leaf, what this port's own rounding and its dynamics
make of a one-spacing difference: its noise floor, with nothing compiled again, no byte more held per
device, and no second device count or process (one accelerator chip has neither).

Measured against the device-count twin (``../shared/experiments/same_program_twin``, docs/verdict.md):
per-leaf floors P/T median 1.6 [p5 0.5, p95 6.8] over 1,145 leaves, no correct port outside
``max(10 P, 8 spacings)``, the learning-rate slips caught as often.

A value's direction comes from its own bits (a hash of them, ``draw`` mixed in): the same value is moved
the same way wherever it is, in whichever rows a process or a recorded step holds, with no generator
state to keep in step. Zeros, infinities and NaNs stay as they are.
"""

import dataclasses
from typing import Any

import jax
import numpy as np

from equivalence.core.port.tolerance import is_float

WIDTHS = {2: np.uint16, 4: np.uint32, 8: np.uint64}  # IEEE binary floats of these byte sizes, as their bits
CARRIED = ('ema',)  # groups that hold the initial parameters themselves: a parameter nudge is carried, not grown


@dataclasses.dataclass(frozen=True)
class Nudged:
    """A twin of the run's own program, its inputs moved by one spacing (``draw``: which directions);
    ``params``: linen's initial parameters as well as the batches (else the batches alone)."""

    draw: int = 0
    params: bool = True

    def __str__(self) -> str:
        moved = 'parameters and batches' if self.params else 'batches'
        return f"the run's own program, its {moved} one spacing off"

    def measures(self, group: str) -> bool:
        """Whether its difference from the run is a floor for ``group``: an EMA starts as the parameters, so a
        parameter nudge stays in it as itself (one spacing of the leaf), not as what the steps make of it;
        the EMA's floor is the batch-only twin's (the where_ports EMA slip 'python-float', 8 to 10 spacings,
        hid under the parameter nudge's)."""
        return not (self.params and group in CARRIED)


DRAWS = (Nudged(0), Nudged(1, params=False))  # a leaf's floor is the larger of theirs (BatchNorm's scales absorb
# a batch-only nudge: the experiment's P = 0 there; the parameters' nudge reaches them)


def nudge(x: Any, draw: int) -> Any:
    """Every finite, nonzero float of ``x`` moved by one spacing of its dtype, up or down in magnitude by
    a hash of its bits and ``draw``; anything else as it is (a host numpy array out, or ``x`` itself)."""
    a = np.asarray(x)
    if not is_float(a.dtype) or a.dtype.itemsize not in WIDTHS:
        return x
    bits = a.view(WIDTHS[a.dtype.itemsize])
    wide = bits.astype(np.uint64)
    up = (_mix(wide ^ np.uint64(draw + 1)) & np.uint64(1)).astype(bool)
    moved = np.where(up, wide + np.uint64(1), wide - np.uint64(1)).astype(bits.dtype)  # the magnitude's bits
    keep = ~np.isfinite(a.astype(np.float64)) | (a == 0)
    return np.where(keep, bits, moved).view(a.dtype)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every bit of the result depends on every bit of ``z``."""
    with np.errstate(over='ignore'):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def tree(x: Any, draw: int) -> Any:
    return jax.tree.map(lambda v: nudge(v, draw), x)


def variables(variables_: dict, draw: int) -> dict:
    """Linen's initial variables, its parameters nudged (statistics and counters as they were)."""
    return {name: tree(v, draw) if name == 'params' else v for name, v in variables_.items()}


def inputs(inputs_: Any, twin: Nudged) -> Any:
    """``run.inputs.Inputs`` with linen's parameters and every batch nudged by ``twin``'s draw."""
    whole = None if inputs_.whole is None else [tree(c, twin.draw) for c in inputs_.whole]
    calls = [tree(c, twin.draw) for c in inputs_.calls]
    moved = variables(inputs_.variables, twin.draw) if twin.params else inputs_.variables
    return dataclasses.replace(inputs_, variables=moved, calls=calls, whole=whole)
