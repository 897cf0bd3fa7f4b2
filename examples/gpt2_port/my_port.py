"""GPT-2's port, told to the suite at level 2: the team's ``train_step(state, batch, dropout_rng)`` (pmapped
by the suite, as the team's ``p_train_step`` pmaps it) and the NNX ``train_step``, each called once per
step with a fresh key.

python -m equivalence.run --workload my_port:LOOP
python -m equivalence.run --workload my_port:LOOP --devices 4 --steps-per-call 2 --calls 2
python -m equivalence.run --workload my_port:LOOP_LN_EPS_SLIP      # exit 1: nnx.LayerNorm's default epsilon
python -m equivalence.run --workload my_port:LOOP_DECAY_ALL_SLIP   # exit 1: AdamW without its mask

Real sizes: ``sized(name)`` is ``LOOP`` at one of ``SIZES``, the same code with the linen model's
fields and the NNX model's arguments set, data of that size and the batch that size wants;
``sized(name, epsilon=1e-6)`` and ``sized(name, mask=None)`` put the slips at that size. Parameters
counted with ``jax.eval_shape`` of the linen init:

    size  vocabulary  positions  layers x width, heads  sequence  parameters   batch
    tiny  100         32         2 x 32, 4              16             29,696     16  (= LOOP)
    124m  50257       1024       12 x 768, 12           256       124,439,808      8  GPT-2 small
    774m  50257       1024       36 x 1280, 20          256       774,030,080      2  GPT-2 large

``124m`` is GPT-2 small's every parameter (its 1024 learned positions, of which a sequence of 256 uses
the first 256). Its batch of 8 sequences is 2,048 tokens, and the logits alone of one step are 411 MB
(8 x 256 x 50257 floats). ``LOOP_124M`` is that size, ``LOOP_124M_LN_EPS_SLIP`` and
``LOOP_124M_DECAY_ALL_SLIP`` its slips:

python -m equivalence.run --workload my_port:LOOP_124M --devices 1 --steps-per-call 2 --calls 1 --batch-size 2

on a 2-core CPU: 6 minutes, 17.5 GB of memory at the peak (docs/examples.md, real sizes).

``LOOP_774M`` is GPT-2 large: one train state (its parameters and AdamW's two moments) is 9.3 GB. The suite's
pmap side donates no train state, so its step holds two, 18.6 GB: on a 16 GB accelerator ``run`` and ``record``
refuse it before anything trains. It is the model that fits a team's own training, which donates its state, and not
a check (docs/record.md, what a check holds).
"""

import dataclasses
import functools
import re

import legacy_code as old
import nnx_code as new

from equivalence import LoopPort


def names(path: str) -> str:
    """linen's ``h_3/attn`` -> NNX's ``h/3/attn``; every other name is GPT-2's on both sides."""
    return re.sub(r'^h_(\d+)', r'h/\1', path)


LOOP = LoopPort(
    name='gpt2-port',
    legacy_model=old.GPT2,
    nnx_model=lambda rngs: new.GPT2(rngs=rngs),
    make_data=old.make_data,
    legacy_state=lambda v: old.create_train_state(v['params']),
    legacy_step=old.train_step,
    new_state=lambda model: (model, new.create_optimizer(model)),
    new_step=lambda ts, batch, key: new.train_step(*ts, batch, key),
    step_form='state_rng',
    loss='loss',
    init_args=lambda batch: (batch['input_ids'], False),  # GPT2.init(input_ids, train=False)
    names=names,
    rng_modes=('global',),  # the NNX step takes one key for the global batch
    default_batch=16,
)

# Two porting slips. nnx.LayerNorm left at its default epsilon (1e-6) where GPT-2's is 1e-5:
LOOP_LN_EPS_SLIP = dataclasses.replace(LOOP, nnx_model=lambda rngs: new.GPT2(rngs=rngs, epsilon=1e-6))
# AdamW without its mask (optax's default): the biases and the LayerNorm scales decayed too.
LOOP_DECAY_ALL_SLIP = dataclasses.replace(LOOP, new_state=lambda model: (model, new.create_optimizer(model, mask=None)))


@dataclasses.dataclass(frozen=True)
class Size:
    """One size: the model's sizes (linen fields, NNX arguments of the same names), the sequence, the batch."""

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    seq_len: int
    batch: int  # the port's default global batch

    def model(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ('seq_len', 'batch')}


SIZES = {  # parameters: see the module docstring
    'tiny': Size(100, 32, 32, 2, 4, 16, 16),
    '124m': Size(50257, 1024, 768, 12, 12, 256, 8),
    '774m': Size(50257, 1024, 1280, 36, 20, 256, 2),
}


def sized(name: str, epsilon: float = old.LAYER_NORM_EPSILON, mask=new.decay_mask_fn) -> LoopPort:
    """``LOOP`` at the size ``name`` of ``SIZES``; ``epsilon=1e-6`` or ``mask=None``: with a slip."""
    size = SIZES[name]
    model = functools.partial(old.GPT2, **size.model())
    slip = ('-ln-eps-slip' if epsilon != old.LAYER_NORM_EPSILON else '') + ('-decay-all-slip' if mask is None else '')
    return dataclasses.replace(
        LOOP,
        name=f'gpt2-port-{name}{slip}',
        legacy_model=model,
        nnx_model=lambda rngs: new.GPT2(rngs=rngs, epsilon=epsilon, **size.model()),
        make_data=functools.partial(old.make_data, vocab_size=size.vocab_size, seq_len=size.seq_len),
        legacy_state=lambda v: old.create_train_state(v['params'], model=model()),
        new_state=lambda model: (model, new.create_optimizer(model, mask=mask)),
        default_batch=size.batch,
    )


LOOP_TINY, LOOP_124M, LOOP_774M = (sized(name) for name in SIZES)
LOOP_124M_LN_EPS_SLIP = sized('124m', epsilon=1e-6)
LOOP_124M_DECAY_ALL_SLIP = sized('124m', mask=None)
