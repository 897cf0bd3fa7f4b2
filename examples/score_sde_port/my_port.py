"""score_sde's trainer and its NNX port, checked as the suite's own question asks it.

The pattern the suite exists for: a linen UNet trained by
``jax.pmap(functools.partial(jax.lax.scan, train_step), axis_name='batch', donate_argnums=1)``, called
as ``p_train_step((next_rng, pstate), batch)`` with per-device keys, against its NNX port: an NNX
model, ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, an EMA, K steps fused by ``nnx.jit(nnx.scan)``.

- ``legacy_code.py``: score_sde's pieces at 8x8 (``models/ddpm.py``, ``losses.py``, ``run_lib.py``): a
  UNet with a sinusoidal time embedding, a residual block (``GroupNorm``, ``Dropout``), a strided
  downsampling, self-attention and a nearest upsampling; the VP SDE's denoising loss, the step's key
  driving the times, the noise and dropout; ``optimize_fn`` (warmup on the step before it is
  counted, global-norm clipping after the ``pmean``, Adam), the EMA, ``step + 1``, ``pmean`` of the loss;
- ``nnx_code.py``: the NNX UNet (its attributes named, ``NAMES``), one optax chain (clipping, Adam,
  the warmup as a schedule of optax's count), the EMA a copy of the model, and ``train_calls``: K
  steps in one ``nnx.jit(nnx.scan)`` that keeps score_sde's per-device keys, each device's rows of
  the global batch drawn from that device's key (vmapped, as docs/randomness.md shows).

The port is about 30 lines: ``legacy_step`` is ``p_train_step`` itself (the suite runs the step it wraps
under its own pmap), ``rng_modes=('per-device',)`` hands both sides the same ``[D, 2]`` keys, and
``new_groups`` reads the chain's Adam state as score_sde's Adam moments. Not compared, and said so:
the legacy state's ``lr`` and ``ema_rate`` (hyperparameters kept in score_sde's ``State``).

python -m equivalence.run --workload my_port:LOOP --devices 2 --steps-per-call 2 --calls 2              # exit 0
python -m equivalence.run --workload my_port:LOOP_WARMUP_SLIP --devices 2 --steps-per-call 2 --calls 2  # exit 1
python -m pytest                                                           # D = 1, 2, 4, 8 and the slip
"""

import dataclasses

import legacy_code as old
import nnx_code as new
from flax import nnx

from equivalence import LoopPort


def new_state(model: new.UNet) -> new.TrainState:
    return new.TrainState(model, new.make_tx())


def new_call(ts: new.TrainState, keys_D, batch_KxG):
    return ts, new.train_calls(ts.model, ts.optimizer, ts.ema, keys_D, batch_KxG)


def new_groups(ts: new.TrainState) -> dict:
    """The NNX state by group; the optimizer state is the chain's Adam (clipping keeps none, the
    schedule's count is the step), as score_sde keeps flax.optim.Adam's moments."""
    params = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.Param))  # noqa: E731
    adam = nnx.to_pure_dict(nnx.state(ts.optimizer.opt_state))[1]  # chain: (clipping, Adam, schedule)
    return {'params': params(ts.model), 'opt_state': adam, 'ema': params(ts.ema), 'model_state': {},
            'step': {'step': ts.optimizer.step[...]}}  # fmt: skip


LOOP = LoopPort(
    name='score-sde-port',
    legacy_model=old.UNet,
    nnx_model=lambda rngs: new.UNet(rngs=rngs),
    make_data=old.make_data,
    init_args=lambda batch: (batch['image'], batch['image'][:, 0, 0, 0]),  # UNet.init(x, labels, train=False)
    init_kwargs=lambda batch: {'train': False},
    legacy_state=old.create_state,
    legacy_step=old.p_train_step,  # score_sde's jax.pmap(partial(lax.scan, train_step)), as run_lib builds it
    axis_name='batch',
    new_state=new_state,
    new_call=new_call,
    new_groups=new_groups,
    names=new.NAMES,
    rng_modes=('per-device',),  # score_sde's [D, 2] keys, row d on device d
    default_batch=8,
)

# The slip: the warmup read from the step after it is counted, so the first update is not 0.
LOOP_WARMUP_SLIP = dataclasses.replace(
    LOOP, new_state=lambda model: new.TrainState(model, new.make_tx(lambda count: new.warmup_schedule(count + 1)))
)
