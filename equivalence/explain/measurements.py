"""What explain measures about one path's compiled call, and how it counts.

The data model the other parts read: ``Placement`` (one input of the call and where it
lives), ``PathMeasurement`` (everything read from one compiled call) and the counting of
collectives per step. Pure Python: no JAX.
"""

import dataclasses
from typing import Any

import numpy as np

from equivalence.explain import hlo

COUNTING = (
    'one compiled call of K fused steps; a collective inside the scan loop runs K times per call '
    '(XLA records the trip count); per step = per call / K; bytes = the operands each device puts in, '
    'per device (a ring all-reduce sends about 2(D-1)/D times that over the wire)'
)
MOVERS = ('all-gather', 'all-to-all', 'collective-permute')  # collectives that move data, not sums
QUESTIONS = {
    'replicated': 'Is the model replicated on every device?',
    'own_slice': 'Does each device run the forward pass on its own slice of the batch?',
    'gradients': 'How are the gradients combined?',
}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one input of the compiled call lives, from the call's own input shardings."""

    group: str  # 'keys', 'params', 'opt_state', 'ema', 'model_state', 'step', 'batch'
    name: str  # e.g. 'params/hidden/kernel', 'model/hidden/kernel', 'x'
    shape: tuple[int, ...]  # of the array the call takes
    dtype: str
    spec: tuple  # the PartitionSpec's entries, e.g. (None, 'data'); () when replicated
    mesh: dict[str, int]  # mesh axis -> size
    devices: int  # devices holding a piece of it
    shard_shape: tuple[int, ...]  # what one device holds
    stacked: bool  # pmap state: axis 0 stacks one copy per device, so a device's slice is a whole copy
    example_axes: tuple[int, ...] = ()  # batch leaves: the axes that index examples ([D, K, B]: 0 and 2)
    sharding: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape

    @property
    def per_device_shape(self) -> tuple[int, ...]:
        return self.shard_shape[1:] if self.stacked else self.shard_shape

    @property
    def full_copy(self) -> bool:
        """Every device holds all of the leaf."""
        return size(self.per_device_shape) == size(self.logical_shape)

    @property
    def pieces(self) -> int:
        """Distinct pieces the leaf is cut into: 1 when every device holds a whole copy."""
        return size(self.logical_shape) // max(size(self.per_device_shape), 1)

    @property
    def shard_bytes(self) -> int:
        return size(self.shard_shape) * itemsize(self.dtype)

    @property
    def rows_per_device(self) -> int:
        return size(tuple(self.shard_shape[a] for a in self.example_axes))

    @property
    def global_rows(self) -> int:
        return size(tuple(self.shape[a] for a in self.example_axes))

    def spec_text(self) -> str:
        return 'PartitionSpec(' + ', '.join(repr(s) for s in self.spec) + ')'


@dataclasses.dataclass(frozen=True)
class PathMeasurement:
    """Everything measured about one path's compiled call; the answers read only this."""

    path: str  # 'legacy' or 'nnx'
    title: str
    program: str  # HLO module header and how the call was traced
    devices: int  # D
    steps_per_call: int  # K
    collectives: tuple[hlo.Collective, ...]  # every one in the program
    placements: tuple[Placement, ...]
    memory: dict[str, int]  # per device, from compiled.memory_analysis()
    copies_spread: float | None  # max |copy on device d - copy on device 0| over full-copy parameters
    notes: tuple[str, ...] = ()  # how the program was built where it is not the usual way (sharding.take_fallbacks)


def size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


KEY_BYTES = {'key<fry>': 8, 'key<rbg>': 16, 'key<unsafe_rbg>': 16}  # typed PRNG keys: their uint32 words


def itemsize(dtype: str) -> int:
    return KEY_BYTES[dtype] if dtype in KEY_BYTES else np.dtype(dtype).itemsize


def per_step(c: hlo.Collective, k: int) -> float | None:
    """Executions of collective ``c`` per training step."""
    return None if c.per_call is None else c.per_call / k


def bytes_per_step(c: hlo.Collective, k: int) -> float | None:
    return None if c.per_call is None else c.per_call * c.bytes / k


def totals(m: PathMeasurement) -> dict[str, dict[str, float | None]]:
    """Per kind: executions and payload bytes per step (None if a loop's trip count is unknown)."""
    out = {}
    for c in m.collectives:
        t = out.setdefault(c.kind, {'count_in_program': 0, 'per_step': 0.0, 'bytes_per_step': 0.0})
        t['count_in_program'] += 1
        for key, value in (
            ('per_step', per_step(c, m.steps_per_call)),
            ('bytes_per_step', bytes_per_step(c, m.steps_per_call)),
        ):
            t[key] = None if value is None or t[key] is None else t[key] + value
    return out


def gradient_operands(m: PathMeasurement) -> list[tuple[hlo.Collective, hlo.Operand]]:
    """``(collective, operand)`` for every operand made by the backward pass."""
    return [(c, o) for c in m.collectives for o in c.operands if o.role == 'gradient']


def dims_text(shape: tuple[int, ...]) -> str:
    return '[' + ', '.join(map(str, shape)) + ']'


def bytes_text(n: float) -> str:
    return f'{n:,.0f} B'
