"""The port once ``legacy_code.py`` is deleted: its pmap side read from a reference, recorded while it ran.

python -m equivalence.record --workload my_port:LOOP --devices 2 --out loop.npz       # once, where the pmap code runs
python -m equivalence.run --workload new_only:LOOP --devices 2 --reference loop.npz  # every CI run after: exit 0
python -m equivalence.run --workload new_only:LOOP_EPSILON_SLIP --devices 2 --reference loop.npz         # exit 1

Every field of the pmap side is ``RECORDED``: the check never calls it, so nothing here imports the pmap code
(docs/record.md).
"""

import dataclasses

import nnx_code as new
from flax import nnx

from equivalence import RECORDED, LoopPort


def nnx_state(model):
    return model, nnx.Optimizer(model, new.make_tx(), wrt=nnx.Param)


def nnx_call(train_state, key, batch_KxG):
    model, optimizer = train_state
    return train_state, new.train_calls(model, optimizer, key, batch_KxG)


LOOP = LoopPort(
    name='mlp-port-loop',  # the name it was recorded under (my_port.LOOP's)
    legacy_model=RECORDED,
    nnx_model=lambda rngs: new.MLP(rngs=rngs),
    make_data=RECORDED,
    legacy_state=RECORDED,
    legacy_step=RECORDED,
    new_state=nnx_state,
    new_call=nnx_call,
    init_args=RECORDED,
    names={'Dense_0': 'fc1', 'LayerNorm_0': 'norm', 'Dense_1': 'fc2'},
    rng_modes=('global',),
)

LOOP_EPSILON_SLIP = dataclasses.replace(LOOP, nnx_model=lambda rngs: new.MLP(rngs=rngs, epsilon=1e-5))
