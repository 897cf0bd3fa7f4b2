"""The language model's port, told to the suite: the pmap step and the functional-NNX step, each
passed as written (``train_step(state, batch, learning_rate_fn, label_smoothing=0.0,
dropout_rng=None)``, extra arguments bound with ``functools.partial``), and the NNX train state
built as flax's lm1b_nnx builds it: no wrapper, no groups.

python -m equivalence.run --workload my_port:PORT
python -m equivalence.run --workload my_port:PORT_B2_SLIP   # exit 1: Adam's second moments
"""

import dataclasses
import functools

import legacy_code as old
import nnx_code as new

from equivalence import LoopPort

NAMES = {'Embed_0': 'embed', 'LayerNorm_0': 'norm', 'Dense_0': 'hidden', 'Dense_1': 'head'}

PORT = LoopPort(
    name='functional-nnx-port',
    legacy_model=old.LanguageModel,
    nnx_model=lambda rngs: new.LanguageModel(rngs=rngs),
    make_data=old.make_data,
    legacy_state=lambda v: old.create_train_state(v['params']),
    legacy_step=functools.partial(
        old.train_step, learning_rate_fn=old.learning_rate_fn, label_smoothing=old.LABEL_SMOOTHING
    ),  # fmt: skip
    new_state=new.create_train_state,  # the NNX model, holding linen's weights -> lm1b_nnx's TrainState
    new_step=functools.partial(
        new.jit_train_step, learning_rate_fn=new.learning_rate_fn, label_smoothing=new.LABEL_SMOOTHING
    ),  # fmt: skip
    step_form='state_rng',
    rng_arg='dropout_rng',  # both steps take their key by this keyword
    loss=lambda m: m['loss'] / m['denominator'],
    init_args=lambda batch: (batch['inputs'], False),
    names=NAMES,
    rng_modes=('global',),  # both steps fold one key, not a [D, 2] array of them
    default_batch=16,
)

# A porting slip: Adam's b2 left at optax's default 0.999 where the pmap side says 0.98.
PORT_B2_SLIP = dataclasses.replace(PORT, new_state=functools.partial(new.create_train_state, b2=0.999))
