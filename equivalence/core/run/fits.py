"""Whether a check fits on its devices, found before anything trains (issue 59): a check holds the pmap
side's train state (replicated on every device) and the new side's at once, so a model that fits on a device
once may not fit twice. Where the device says how many bytes it holds (a TPU's or a GPU's allocator; the CPU
backend says none: ``EQUIVALENCE_DEVICE_BYTES`` sets a budget there), a check whose two train states alone
need more is refused with one line (``ConfigError``, exit 2) naming the bytes and the way out: record the pmap
side first (``python -m equivalence.record``), then check against the reference, which holds the new side
alone (its final state leaves the device before its twins run: ``sides.run_new``).

The train states are read abstractly (``jax.eval_shape``, ``nnx.eval_shape``: nothing allocated). What the
programs hold beside them (activations, temporaries) is not counted: a check refused here could not have
run, and one let through may still need more, which XLA then says itself.
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


def state_bytes(kind: Kind, variables: dict) -> int | None:
    """The bytes of one side's train state, read abstractly: the new side's (``kind.checkpoint_state``), else
    the pmap side's (``kind.legacy_train_state``); None where neither can be built so."""
    try:
        return _bytes(nnx.state(nnx.eval_shape(kind.checkpoint_state)))
    except Exception:  # noqa: BLE001 -- a new side of linen alone: the pmap side's state stands for it
        pass
    try:
        return _bytes(jax.eval_shape(lambda: kind.legacy_train_state(variables)))
    except Exception:  # noqa: BLE001 -- not measurable: nothing is refused
        return None


def check(kind: Kind, config: Run, variables: dict, sides: int = 2) -> None:
    """``ConfigError`` (exit 2) where ``sides`` train states (2: a check; 1: a check against a reference, a
    recording) do not fit on one device; nothing where the device's bytes are not known."""
    held = limit()
    if held is None:
        return
    one = state_bytes(kind, variables)
    if one is None:
        return
    shards = 1 if config.strategy in ('dp', 'shard_map') else config.devices  # the new side's state split so
    need = one if sides == 1 else one + one // shards
    if need <= held:
        return
    if sides == 1:
        raise ConfigError(f'the train state takes {need / 1e9:.2f} GB a device and the device holds {held / 1e9:.2f} '
                          'GB: it does not fit on this device at all')  # fmt: skip
    raise ConfigError(
        f'the two sides do not fit on one device together: their train states alone take {need / 1e9:.2f} GB a '
        f'device ({one / 1e9:.2f} GB each), and the device holds {held / 1e9:.2f} GB; record the pmap side first '
        "(python -m equivalence.record, with this command's --workload and flags and --out ref.npz), then check with "
        '--reference ref.npz, which holds the new side alone (docs/record.md)'
    )
