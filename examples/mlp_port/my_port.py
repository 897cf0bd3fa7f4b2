"""The port, told to the suite: level 1 (the two models) and level 2 (the two loops).

python -m equivalence.run --workload my_port:MODEL
python -m equivalence.run --workload my_port:LOOP
python -m equivalence.run --workload my_port:LOOP_FAST   # the same loop in the form bench advises
python -m equivalence.run --workload my_port:MODEL_GELU_SLIP   # a porting slip: exit 1, naming the leaves
"""

import dataclasses

import jax.numpy as jnp
import legacy_code as old
import nnx_code as new
from flax import nnx

from equivalence import LoopPort, ModelPort


# Level 1: the suite's loops train your two models.
def linen_loss(model, params, model_state, batch, noise):
    x, y = batch
    return jnp.mean((model.apply({'params': params}, x, train=True) - y) ** 2, axis=-1)  # masks: the suite's


MODEL = ModelPort(
    name='mlp-port',
    legacy_model=old.MLP,
    nnx_model=lambda rngs: new.MLP(rngs=rngs),
    legacy_loss=linen_loss,
    nnx_loss=lambda model, batch, noise: new.per_example_loss(model, batch),
    make_data=old.make_data,
    make_tx=old.make_tx,
    init_args=lambda batch: (batch[0], False),  # MLP.init(x, train=False)
    names='structure',  # Dense_0 -> fc1, LayerNorm_0 -> norm, Dense_1 -> fc2, found by their shapes
)


# Level 2: your own pmap step and your own nnx.jit(nnx.scan) call.
def nnx_state(model):
    return model, nnx.Optimizer(model, new.make_tx(), wrt=nnx.Param)


def nnx_call(train_state, key, batch_KxG):
    model, optimizer = train_state
    return train_state, new.train_calls(model, optimizer, key, batch_KxG)


LOOP = LoopPort(
    name='mlp-port-loop',
    legacy_model=old.MLP,
    nnx_model=lambda rngs: new.MLP(rngs=rngs),
    make_data=old.make_data,
    legacy_state=old.create_state,
    legacy_step=old.train_step,
    new_state=nnx_state,
    new_call=nnx_call,
    init_args=lambda batch: (batch[0], False),
    axis_name=old.AXIS,
    names={'Dense_0': 'fc1', 'LayerNorm_0': 'norm', 'Dense_1': 'fc2'},
    rng_modes=('global',),  # the NNX loop takes one key per call, not one per device
)


# Level 2 again, the NNX loop rewritten as `python -m equivalence.bench --workload my_port:LOOP`
# advises: jax.jit over the split state (a plain dict), donated, the loss averaged after the scan.
# python -m equivalence.bench --workload my_port:LOOP_FAST times it against the same pmap loop.
LOOP_FAST = dataclasses.replace(
    LOOP,
    name='mlp-port-loop-fast',
    new_state=lambda model: new.split_state(model, nnx.Optimizer(model, new.make_tx(), wrt=nnx.Param)),
    new_call=lambda ts, key, batch_KxG: new.train_calls_fast(ts, key, batch_KxG),
)

# Two porting slips, each a one-argument change on the NNX side.
MODEL_GELU_SLIP = dataclasses.replace(MODEL, nnx_model=lambda rngs: new.MLP(rngs=rngs, approximate_gelu=False))
LOOP_EPSILON_SLIP = dataclasses.replace(LOOP, nnx_model=lambda rngs: new.MLP(rngs=rngs, epsilon=1e-5))
