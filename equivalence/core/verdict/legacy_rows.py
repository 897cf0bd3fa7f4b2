"""The legacy twin with per-device keys: the pmap side on n devices, drawing what the run's D draw.

With per-device keys the pmap run's device d draws its G/D examples' random numbers (Dropout masks,
noise) from its own key row d. The same step on n devices would give each device one key of n and
draw other numbers, so a legacy twin on another count computed something else: a model port that
draws random numbers had none, and cnn with Adam eps 1e-8, seed 5, D = 8, was a false MISMATCH that
only the pmap side's own floor explains (docs/verdict.md).

Here every one of the n devices holds the run's D key rows, splits each row's chain as the run's
device does, draws each row's numbers for its G/D examples, and keeps those of the G/n examples it
holds (as the global mode cuts one global draw): every example gets the numbers it got in the run,
whatever n. Everything else
is ``legacy_pmap.train.make_step_fn``: the loss and gradient of G/n examples per device, ``pmean``
over n devices, so only the order of the sums changes. Not the same step vmapped over the D rows on
one device: that keeps each device's grouping of the sums, where this chaos is born (``judge``).
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from equivalence.core.port import convert
from equivalence.core.port.config import RunConfig
from equivalence.core.port.ports import ModelPort
from equivalence.core.run import setups, sides
from equivalence.distributed import rows
from legacy_pmap import train as legacy


def draw_rows(noise_fn: Callable, keys_D: jax.Array, batch) -> dict:
    """This device's numbers: the run's D key rows each draw those of their G/D examples (as the run's
    devices do), and this device keeps the rows of the examples it holds (as the global mode cuts them)."""
    d, b = keys_D.shape[0], jax.tree.leaves(batch)[0].shape[0]
    g = b * jax.lax.axis_size(legacy.AXIS)
    noise_DxB = jax.vmap(lambda k: noise_fn(k, legacy.batch_spec(batch, g // d)))(keys_D)
    start = jax.lax.axis_index(legacy.AXIS) * b
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a.reshape(g, *a.shape[2:]), start, b), noise_DxB)


def draw_with_rows(noise_fn: Callable) -> Callable:
    """``legacy_pmap.train.make_step_fn``'s ``draw`` in per-device mode, its key chain the run's ``[D, 2]``
    on every device: each row split as the run's device splits it, each row's numbers drawn (``draw_rows``)."""

    def draw(rng, batch):
        pairs = jax.vmap(jax.random.split)(rng)  # rng, step_rng = split(rng), once per key row
        return pairs[:, 0], draw_rows(noise_fn, pairs[:, 1], batch)

    return draw


@dataclasses.dataclass
class RowsSetup(setups.LegacySetup):
    """The pmap side on ``n`` devices given the run's ``[D, 2]`` keys, all of them on every device."""

    run_devices: int = 1  # D: the checked run's device count, whose keys are drawn

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        n = self.config.devices
        rng, keys_D = legacy.next_call_keys(rng, self.run_devices, 'per-device')
        batch_nxK = jax.tree.map(lambda v: legacy.shard_batch(np.asarray(v), n), batch_KxG)
        return rng, ((jnp.broadcast_to(keys_D, (n, *keys_D.shape)), self.pstate), batch_nxK)


def run(port: ModelPort, config: RunConfig, n: int, variables: dict, calls: list, rng) -> sides.PathResult:
    """The legacy twin on ``n`` devices of a per-device run of ``config``: its
    ``PathResult``, leaves named as the NNX side names them."""
    on_n = dataclasses.replace(config, devices=n, strategy='dp', mesh=None, nnx_form='split')
    mapping = setups.check_names(port, variables)
    tx, noise = port.make_tx(1.0), setups.port_noise(port, setups.uses_dropout(port))
    model, loss = port.legacy_model(), setups.legacy_loss(port, on_n)
    step = legacy.make_step_fn(model, loss, noise, tx, port.ema_rate, 'per-device', draw=draw_with_rows(noise))
    pstate = legacy.replicate(legacy.create_state(variables, tx, port.ema_rate), rows.local_devices(n))
    setup = RowsSetup(legacy.make_fused_call(step, jax.devices()[:n]), pstate, on_n, run_devices=config.devices)
    losses, per_call = sides.run_calls(setup, calls, rng, mapping, sides.silent, 'legacy twin')
    return sides.PathResult(convert.rename(setup.neutral(), mapping), losses, per_call, setup.pstate)
