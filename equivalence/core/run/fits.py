"""Whether a check fits on its devices, found before anything trains: a side's step runs with its starting
train state kept beside the one it returns (the check donates nothing: the floor's twins and the first-step hold
start again from the starting state), and the pmap side's state (replicated on every device) stays on the device
while the new side runs (and the new side's starting state while the pmap side runs, where the new program is
the suite's own). So a side needs two of its train states at its step, and a check of both sides three: a model
that fits a team's own training, which may donate its state, can fit a check against a reference (one side) and
not a check of both sides, or neither. Where the device says how
many bytes it holds (a TPU's or a GPU's allocator; the CPU backend says none: ``EQUIVALENCE_DEVICE_BYTES`` sets a
budget there), a check that needs more is refused with one line (``ConfigError``, exit 2) naming the bytes and,
where one side fits, the way out: record the pmap side first (``python -m equivalence.record``), then check
against the reference, which holds the new side alone.

The train states are read abstractly (``jax.eval_shape``, ``nnx.eval_shape``: nothing allocated). What the
programs hold beside them (gradients, activations, temporaries) is not counted: a check refused here could not
have run, and one let through may still need more, which XLA then says (``cli``: one line, exit 2).
"""

import os

import jax
import numpy as np
from flax import nnx

from equivalence.core.measure import peaks
from equivalence.core.port.config import ConfigError
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Run

ENV = 'EQUIVALENCE_DEVICE_BYTES'  # a device's bytes where its backend says none (the CPU's): a budget of one's own


def limit() -> int | None:
    """The bytes one device holds: ``EQUIVALENCE_DEVICE_BYTES``, else its allocator's limit, else None."""
    given = os.environ.get(ENV)
    return int(float(given)) if given else peaks.device_limit_bytes()


def _bytes(tree) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
                   if hasattr(x, 'shape') and hasattr(x, 'dtype')))  # fmt: skip


def state_bytes(kind: Kind, variables: dict, legacy: bool = False) -> int | None:
    """The bytes of one side's train state, read abstractly: the new side's (``kind.checkpoint_state``), else
    the pmap side's (``kind.legacy_train_state``; first, with ``legacy``: a recording's); None where neither can
    be built so."""
    new = lambda: _bytes(nnx.state(nnx.eval_shape(kind.checkpoint_state)))
    old = lambda: _bytes(jax.eval_shape(lambda: kind.legacy_train_state(variables)))
    for read in (old, new) if legacy else (new, old):
        try:
            return read()
        except Exception:  # noqa: BLE001 -- a side not built so (a new side of linen alone): the other's stands
            pass
    return None


def check(kind: Kind, config: Run, variables: dict, sides: int = 2, legacy: bool = False) -> None:
    """``ConfigError`` (exit 2) where a check of ``sides`` sides (2: both; 1: against a reference, or a recording:
    ``legacy``) does not fit on one device; nothing where the device's bytes are not known."""
    held = limit()
    if held is None:
        return
    one = state_bytes(kind, variables, legacy)
    if one is None:
        return
    shards = 1 if config.strategy in ('dp', 'shard_map') else config.devices  # the new side's state split so
    side = 2 * one // shards if sides == 1 else 2 * one  # the side that runs: its starting state and its result
    need = side if sides == 1 else side + one // shards  # and the other side's starting state beside it
    if need <= held:
        return
    states = f'two train states of {one / 1e9:.2f} GB' + (f', split {shards} ways' if shards > 1 and sides == 1 else '')
    if sides == 1 or 2 * one > held:
        raise ConfigError(
            f'{"one side" if sides == 1 else "the pmap side alone"} does not fit on this device: its step holds '
            f'{states} a device (the one it starts from, which the check keeps, and the one it returns): '
            f'{2 * one // (shards if sides == 1 else 1) / 1e9:.2f} GB, and the device holds {held / 1e9:.2f} GB; '
            'check a smaller size of the model, or on a device that holds more'
        )
    raise ConfigError(
        f"the two sides do not fit on one device together: {need / 1e9:.2f} GB a device (each side's starting train "
        f"state and the one the running side's step returns, {one / 1e9:.2f} GB each), and the device holds "
        f"{held / 1e9:.2f} GB; record the pmap side first (python -m equivalence.record, with this command's "
        '--workload and flags and --out ref.npz), then check with --reference ref.npz, which holds the new side '
        'alone (docs/record.md)'
    )
