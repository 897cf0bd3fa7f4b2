"""The workload's migration, told to the suite: the pmap step and the linen + ``jax.jit`` step,
each passed as written, and the jit side's dict state built from linen's variables, as the pmap
side's is: no NNX model, no wrapper, no groups.

The jit step's mesh is built from ``jax.devices()`` when ``jit_code`` is imported, so the suite runs
it on every device the process sees: ``--devices`` equal to that count.

JAX_NUM_CPU_DEVICES=4 python -m equivalence.run --workload my_port:PORT --devices 4
JAX_NUM_CPU_DEVICES=4 python -m equivalence.run --workload my_port:PORT_WARMUP_SLIP --devices 4   # exit 1
"""

import dataclasses

import jit_code as new
import legacy_code as old

from equivalence import LoopPort

PORT = LoopPort(
    name='linen-jit-port',
    legacy_model=old.Classifier,
    make_data=old.make_data,
    legacy_state=lambda v: old.init_optimizer_state(v['params']),
    legacy_step=old.train_step,
    new_state=lambda v: new.create_train_state(v['params'], new.tx),  # linen's variables -> the dict state
    new_step=new.jit_train_step,
    step_form='state',
    loss='loss',
    init_args=lambda batch: (batch['x'],),
    default_batch=32,
)

# A porting slip: the jit side's schedule warms up over 5 steps where the pmap side's took 4.
PORT_WARMUP_SLIP = dataclasses.replace(PORT, new_step=new.make_train_step(old.make_tx(warmup_steps=5)))
