"""HF's own Flax GPT-2 (legacy, pmap) vs a typical NNX port. Correct port: LOOP; slips: LOOP_*."""

import dataclasses
import re

import hf_gpt2_legacy as old
import hf_gpt2_nnx as new

from equivalence import LoopPort


def names(path: str) -> str:
    """linen 'transformer/h/0/attn/...' -> NNX 'h/0/attn/...'."""
    return re.sub(r'^transformer/', '', path)


def port(name, model_kw=None, opt_kw=None):
    model_kw, opt_kw = model_kw or {}, opt_kw or {}
    return LoopPort(
        name=name,
        legacy_model=old.model,
        nnx_model=lambda rngs: new.GPT2(rngs=rngs, **model_kw),
        make_data=old.make_data,
        legacy_state=lambda v: old.create_train_state(v['params']),
        legacy_step=old.train_step,
        new_state=lambda model: (model, new.create_optimizer(model, **opt_kw)),
        new_step=lambda ts, batch, key: new.train_step(*ts, batch, key),
        step_form='state_rng',
        loss='loss',
        init_args=old.init_args,
        init_kwargs=lambda b: {'return_dict': False},
        names=names,
        rng_modes=('global',),
        default_batch=16,
    )


LOOP = port('hf-gpt2')
LOOP_LN_EPS = port('hf-gpt2-ln-eps', {'epsilon': 1e-6})  # true place: h/0/ln_1 (first LayerNorm)
LOOP_GELU_EXACT = port('hf-gpt2-gelu-exact', {'approximate': False})  # true place: h/0/mlp (its activation)
LOOP_ATTN_SCALE = port('hf-gpt2-attn-scale', {'q_scale': 0.9})  # true place: h/0/attn
LOOP_RESID_DROPOUT0 = port('hf-gpt2-resid-drop0', {'resid_pdrop': 0.0})  # true place: h/0/attn (resid_dropout)
LOOP_NO_CAUSAL_MASK = port('hf-gpt2-no-causal', {'causal': False})  # true place: h/0/attn
LOOP_ADAM_B2 = port('hf-gpt2-adam-b2', opt_kw={'b2': 0.999})  # true place: optimizer update
LOOP_WARMUP = port('hf-gpt2-warmup3', opt_kw={'warmup': 3})  # true place: optimizer (learning rate)


# Variant: the NNX port keeps HF's nesting (`transformer` submodule, head outside it); names are the same paths.
def nested(name, opt_kw=None):
    return dataclasses.replace(port(name, opt_kw=opt_kw), nnx_model=lambda rngs: new.GPT2LMHead(rngs=rngs), names=None)


NESTED = nested('hf-gpt2-nested')
NESTED_ADAM_B2 = nested('hf-gpt2-nested-adam-b2', {'b2': 0.999})
NESTED_WARMUP = nested('hf-gpt2-nested-warmup3', {'warmup': 3})
