"""HF's own Flax ViT (legacy, pmap) vs a team's NNX port. Correct port: LOOP; slips: LOOP_* (one constant each,
its true place in the comment; `layer0=` slips touch the first encoder block only)."""

import re

import hf_vit_legacy as old
import hf_vit_nnx as new

from equivalence import LoopPort

_RENAMES = [
    (r'^vit/embeddings/cls_token', 'cls_token'),
    (r'^vit/embeddings/position_embeddings', 'pos_embed'),
    (r'^vit/embeddings/patch_embeddings/projection', 'patch_embed'),
    (r'^vit/encoder/layer/(\d+)/attention/attention/', r'blocks/\1/attn/'),
    (r'^vit/encoder/layer/(\d+)/attention/output/dense', r'blocks/\1/attn/out'),
    (r'^vit/encoder/layer/(\d+)/intermediate/dense', r'blocks/\1/mlp/fc1'),
    (r'^vit/encoder/layer/(\d+)/output/dense', r'blocks/\1/mlp/fc2'),
    (r'^vit/encoder/layer/(\d+)/', r'blocks/\1/'),
    (r'^vit/layernorm', 'norm'),
    (r'^classifier', 'head'),
]


def names(path: str) -> str:
    """linen 'vit/encoder/layer/0/intermediate/dense/kernel' -> NNX 'blocks/0/mlp/fc1/kernel'."""
    for pattern, repl in _RENAMES:
        new_path, n = re.subn(pattern, repl, path)
        if n:
            return new_path
    return path


def port(name, model_kw=None, opt_kw=None):
    model_kw, opt_kw = model_kw or {}, opt_kw or {}
    return LoopPort(
        name=name,
        legacy_model=old.model,
        nnx_model=lambda rngs: new.ViT(rngs=rngs, **model_kw),
        make_data=old.make_data,
        legacy_state=lambda v: old.create_train_state(v['params']),
        legacy_step=old.p_train_step,
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


LOOP = port('hf-vit')
LOOP_LN_EPS = port('hf-vit-ln-eps', {'layer0': {'ln_eps': 1e-6}})  # true place: blocks/0/layernorm_before
LOOP_GELU_TANH = port('hf-vit-gelu-tanh', {'layer0': {'approximate': True}})  # true place: blocks/0/mlp (fc1's gelu)
LOOP_ATTN_SCALE = port('hf-vit-attn-scale', {'layer0': {'q_scale': 0.9}})  # true place: blocks/0/attn (q scale)
LOOP_ATTN_DROP = port(
    'hf-vit-attn-drop02', {'layer0': {'attn_dropout': 0.2}}
)  # true place: blocks/0/attn (its probs' dropout)
LOOP_HIDDEN_DROP0 = port(
    'hf-vit-hidden-drop0', {'layer0': {'out_dropout': 0.0}}
)  # true place: blocks/0/attn (out_dropout, after attn/out)
LOOP_MEAN_POOL = port('hf-vit-mean-pool', {'pool': 'mean'})  # true place: head (its input: mean of tokens, not CLS)
LOOP_ADAM_B2 = port('hf-vit-adam-b2', opt_kw={'b2': 0.99})  # true place: optimizer update (AdamW b2)
LOOP_WARMUP = port('hf-vit-warmup3', opt_kw={'warmup': 3})  # true place: optimizer (learning-rate schedule)
LOOP_DECAY_MASK = port(
    'hf-vit-decay-all', opt_kw={'mask': new.decay_mask_all}
)  # true place: optimizer (weight decay on LN/bias)
