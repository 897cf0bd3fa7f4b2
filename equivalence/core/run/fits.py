"""Whether a check fits on its devices, found before anything trains. A program the suite builds (the pmap
side, a model port's NNX side) donates no train state, so its step holds two at once: the one it starts from and
the one it returns. So the pmap side's step needs two of its train states (replicated on every device), and, where
the new side's program is the suite's own, placed before the pmap side runs, the new side's starting state beside
them; a team's own new step holds what its code holds (two states unless it donates: one is counted). A model that
fits a team's own training, which may donate its state, can fit a check against a reference (the new side alone)
and not a check of both sides, or neither. Where the device says how many bytes it holds (a TPU's or a GPU's
allocator; the CPU backend says none: ``EQUIVALENCE_DEVICE_BYTES`` sets a budget there), a check that needs more is
refused with one line (``ConfigError``, exit 2) naming the bytes and, where the pmap side's step fits, the way out:
record the pmap side first (``python -m equivalence.record``), then check against the reference.

The train states are read abstractly (``jax.eval_shape``, ``nnx.eval_shape``: nothing allocated). What the
programs hold beside them (linen's initial variables, gradients, activations, temporaries) is not counted: a check
refused here could not have run, and one let through may still need more, which XLA then says (``cli``: one line,
exit 2).
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
    """``ConfigError`` (exit 2) where a check of ``sides`` sides (2: both; 1: the new side against a reference, or
    the pmap side recorded: ``legacy``) does not fit on one device; nothing where the device's bytes are not known."""
    held = limit()
    if held is None:
        return
    one = state_bytes(kind, variables, legacy)
    if one is None:
        return
    shards = 1 if config.strategy in ('dp', 'shard_map') else config.devices  # the new side's state split so
    own = kind.new_ahead() is not None  # the new side's program is the suite's own: it donates no state either
    pmap_step = 2 * one  # the pmap side's: its starting state and the one it returns, replicated
    if sides == 1 and not legacy:
        need, what = (2 if own else 1) * one // shards, 'the new side'
    else:
        need, what = pmap_step + (one // shards if sides == 2 and own else 0), 'the pmap side'
    if need <= held:
        return
    if sides == 1 or pmap_step > held:
        alone = need if sides == 1 else pmap_step
        states = f'two train states of {one / 1e9:.2f} GB' if what == 'the pmap side' or own else 'its train state'
        split = f', split {shards} ways' if shards > 1 and what == 'the new side' else ''
        raise ConfigError(
            f'{what} alone does not fit on this device: its step holds {states}{split} ({alone / 1e9:.2f} GB a '
            f'device), and the device holds {held / 1e9:.2f} GB; check a smaller size of the model, or on a device '
            'that holds more'
        )
    raise ConfigError(
        f"the two sides do not fit on one device together: {need / 1e9:.2f} GB a device (the pmap side's step holds "
        f"its starting train state and the one it returns, beside the new side's starting state, {one / 1e9:.2f} GB "
        f'each), and the device holds {held / 1e9:.2f} GB; record the pmap side first (python -m equivalence.record, '
        "with this command's --workload and flags and --out ref.npz), then check with --reference ref.npz, which "
        'holds the new side alone (docs/record.md)'
    )
