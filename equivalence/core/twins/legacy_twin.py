"""The legacy twin: the pmap side run again on another device count, with the same data and keys, so
that chaos born on the pmap side (which no NNX twin sees) widens each leaf's floor (``rule``). With
per-device keys and a model port that draws random numbers, each device draws with the run's D key rows
(``with_rows``): every example gets the numbers it got in the run, whatever the count.

With per-device keys the pmap run's device d draws its G/D examples' random numbers (Dropout masks,
noise) from its own key row d. The same step on n devices would give each device one key of n and
draw other numbers, so a legacy twin on another count computed something else: a model port that
draws random numbers had none, and cnn with Adam eps 1e-8, seed 5, D = 8, was a false MISMATCH that
only the pmap side's own floor explains (docs/verdict.md).
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from equivalence.core.compare import compare, rule
from equivalence.core.compare.findings import LegacyTwin, Refusal
from equivalence.core.compare.rule import MEASURED_FLOOR
from equivalence.core.port import blame
from equivalence.core.port.config import RunConfig
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import ModelPort
from equivalence.core.run import setups, sides
from equivalence.core.run.facts import uses_dropout
from equivalence.core.run.inputs import Inputs
from equivalence.core.state import convert
from equivalence.core.twins import twin
from equivalence.core.twins.unverified import start_params
from equivalence.distributed import rows
from legacy_pmap import train as legacy


def wanted(report: compare.Report, old, new) -> bool:
    """Whether the legacy side's own floor could change this verdict: the NNX twins' floor failed
    float leaves that both sides hold (not a counter, a shape or a NaN), with finite losses and the
    first step within its floor (a slip there is math, which no reordering explains), and not only
    running statistics: chaos moves the parameters, and statistics that differ while the parameters
    and losses agree are computed differently (a BatchNorm momentum), not reordered."""
    bad = [leaf for leaf in rule.failed(report) if not leaf.one_sided and leaf.floor is not None]
    finite = np.isfinite(old.losses).all() and np.isfinite(new.losses).all()
    trained = any(leaf.group != 'model_state' for leaf in bad)
    return trained and bool(finite) and not rule.failed(report, 'first_step')


NOT_RUN = LegacyTwin.Ran.NOT_RUN


def run(kind: Kind, config: Run, old, new, twins: dict, inputs: Inputs):
    """``(the legacy twin's PathResult or None, what was done (``findings.LegacyTwin``), what it raised)``: the
    pmap side again on another device count, with the same data and keys: what reordering its own sums does to
    it. The NNX twins cannot see chaos that lives on the legacy side (cnn, global keys, seed 4: legacy on 8
    devices ends 1.7e-4 from legacy on 1, 2 and 4 and from every NNX run, all within 1.5e-6 of each other).

    Refused, like an NNX twin, when it does not compute what the pmap run computes: its losses at
    steps 1 and 2 more than TWIN_ULPS apart (with per-device keys a model port that draws random
    numbers draws them as the run's D devices do: ``with_rows``; a loop port's own step draws on the
    n devices' keys, and is judged by these losses), or, after the first call, a spread
    already beyond what the NNX twin allows there (``rule.early_excess``): chaos starts at
    rounding level and grows (seed 4: 5.7e-7 after call 1, NNX's twin 5.5e-7; 1.8e-4 after call 4),
    a pmap program whose math depends on its device count (a gradient psum for pmean under Adam acts
    as eps / D) differs from the first updates on. So it needs two calls or more.

    Another count, not the same step vmapped over the D device rows on one device (which would
    keep per-device keys): that keeps each device's grouping of the batch sums, where this chaos
    is born, and ends 3.3e-7 from legacy on 8 in the seed-4 case above, missing it."""
    n = count(config)
    if n is None:
        return None, LegacyTwin(NOT_RUN, why=LegacyTwin.Skip.NO_COUNT), ()
    if config.calls < 2:  # no early state to tell chaos from a real difference
        return None, LegacyTwin(NOT_RUN, why=LegacyTwin.Skip.ONE_CALL), ()
    first = [{'params': tw.params_per_call[0]} for tw in twins.values()]
    twin_first = twin.farthest({'params': new.params_per_call[0]}, first).get('params', {})
    fed, start = compare.feeding_dtypes(old.final), old.start or start_params(inputs.variables, inputs.mapping)
    first_call = (new.params_per_call[0], twin_first, MEASURED_FLOOR, fed, start)
    excess = rule.early_excess(old.params_per_call[0], new.params_per_call[0], *first_call)
    if excess is not None:  # NNX is off after the first call: not chaos, which grows from rounding
        return None, LegacyTwin(NOT_RUN, why=excess), ()
    try:  # run by the kind: with the run's D key rows where its step draws random numbers per device
        recorded = inputs.recorded  # a reference's: the pmap side run so where it was recorded
        other, by_rows = recorded.legacy_twin(n) if recorded is not None else kind.legacy_twin(config, n, inputs)
    except Exception as e:  # noqa: BLE001 -- pmap code written for one device count
        error = f'legacy twin on {n} device(s): {type(e).__name__}: {e}'
        return None, LegacyTwin(LegacyTwin.Ran.RAISED, n, blame.first_line(e)), (error,)
    refusal = rule.twin_refusal(old.losses, other.losses, 'legacy')
    if refusal is None and not np.isfinite(other.losses).all():
        refusal = Refusal(Refusal.Why.ANY_NON_FINITE, side='legacy')
    if refusal is None:  # on another count it computes something else
        excess = rule.early_excess(old.params_per_call[0], other.params_per_call[0], *first_call)
        refusal = Refusal(Refusal.Why.EARLY, side='legacy', excess=excess) if excess is not None else None
    if refusal is not None:  # with per-device keys not handed to it, as a step that draws from its key does
        other_keys = config.devices if config.rng_mode == 'per-device' and not by_rows else None
        return None, LegacyTwin(LegacyTwin.Ran.REFUSED, n, refusal, keys_of=other_keys), ()
    return other, LegacyTwin(LegacyTwin.Ran.MEASURED, n, rows=config.devices if by_rows else None), ()


def count(config: Run) -> int | None:
    """The device count the legacy twin runs on (the first NNX twin's: 1, or 2 on D = 1); None: none fits."""
    counts = twin.twin_counts(config, len(jax.devices()))
    return counts[0] if counts else None


# -- drawing with the run's per-device keys ---------------------------------------------------


def draw_rows(noise_fn: Callable, keys_D: jax.Array, batch) -> dict:
    """This device's numbers: the run's D key rows each draw those of their G/D examples (as the run's
    devices do), and this device keeps the rows of the examples it holds (as the global mode cuts them)."""
    d, b = keys_D.shape[0], jax.tree.leaves(batch)[0].shape[0]
    g = b * jax.lax.psum(1, legacy.AXIS)
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


def on(config: Run, n: int) -> RunConfig:
    """The legacy twin's config: the run's on ``n`` devices, data parallel."""
    return dataclasses.replace(config, devices=n, strategy='dp', mesh=None, nnx_form='split')


def with_rows(port: ModelPort, config: Run, n: int, inputs: Inputs) -> sides.PathResult:
    """The legacy twin on ``n`` devices of a per-device run of ``config``, drawing with the run's D key rows:
    its ``PathResult``, leaves named as the NNX side names them."""
    on_n = on(config, n)
    variables, calls, rng, mapping = inputs.variables, inputs.calls, inputs.rng, inputs.mapping
    tx, noise = port.make_tx(1.0), setups.port_noise(port, uses_dropout(port))
    model, loss = port.legacy_model(), setups.legacy_loss(port, on_n)
    step = legacy.make_step_fn(model, loss, noise, tx, port.ema_rate, 'per-device', draw=draw_with_rows(noise))
    pstate = legacy.replicate(legacy.create_state(variables, tx, port.ema_rate), rows.local_devices(n))
    setup = RowsSetup(legacy.make_fused_call(step, jax.devices()[:n]), pstate, on_n, run_devices=config.devices)
    losses, per_call = sides.run_calls(setup, calls, rng, mapping, sides.silent, 'legacy twin')
    return sides.PathResult(convert.rename(setup.neutral(), mapping), losses, per_call, setup.pstate)
