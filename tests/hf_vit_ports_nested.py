"""The ports of hf_vit_ports.py with the NNX block nested as HF nests it (hf_vit_nnx_nested.py)."""

import dataclasses
import re

import hf_vit_nnx_nested as nested
import hf_vit_ports as flat

_RENAMES = [
    (r'^vit/embeddings/cls_token', 'cls_token'),
    (r'^vit/embeddings/position_embeddings', 'pos_embed'),
    (r'^vit/embeddings/patch_embeddings/projection', 'patch_embed'),
    (r'^vit/encoder/layer/(\d+)', r'blocks/\1'),
    (r'^vit/layernorm', 'norm'),
    (r'^classifier', 'head'),
]


def names(path: str) -> str:
    for pattern, repl in _RENAMES:
        new_path, n = re.subn(pattern, repl, path)
        if n:
            return new_path
    return path


def port(name, model_kw=None, opt_kw=None):
    model_kw = model_kw or {}
    return dataclasses.replace(
        flat.port(name, opt_kw=opt_kw), nnx_model=lambda rngs: nested.ViT(rngs=rngs, **model_kw), names=names
    )


NESTED = port('hf-vit-nested')
NESTED_GELU_TANH = port(
    'hf-vit-nested-gelu-tanh', {'layer0': {'approximate': True}}
)  # true place: blocks/0/intermediate
NESTED_HIDDEN_DROP0 = port(
    'hf-vit-nested-hidden-drop0', {'layer0': {'out_dropout': 0.0}}
)  # true place: blocks/0/attention/output


def port_hf(name, model_kw=None, opt_kw=None):
    model_kw = model_kw or {}
    return dataclasses.replace(
        flat.port(name, opt_kw=opt_kw), nnx_model=lambda rngs: nested.ViTHF(rngs=rngs, **model_kw), names=names
    )


HFNEST = port_hf('hf-vit-hfnest')  # nested as HF, residual inside output
HFNEST_LN_EPS = port_hf('hf-vit-hfnest-ln-eps', {'layer0': {'ln_eps': 1e-6}})  # true place: blocks/0/layernorm_before
HFNEST_GELU_TANH = port_hf(
    'hf-vit-hfnest-gelu-tanh', {'layer0': {'approximate': True}}
)  # true place: blocks/0/intermediate
HFNEST_ATTN_SCALE = port_hf(
    'hf-vit-hfnest-attn-scale', {'layer0': {'q_scale': 0.9}}
)  # true place: blocks/0/attention/attention
HFNEST_ATTN_DROP = port_hf(
    'hf-vit-hfnest-attn-drop02', {'layer0': {'attn_dropout': 0.2}}
)  # true place: blocks/0/attention/attention
HFNEST_HIDDEN_DROP0 = port_hf(
    'hf-vit-hfnest-hidden-drop0', {'layer0': {'out_dropout': 0.0}}
)  # true place: blocks/0/attention/output/dropout
HFNEST_MEAN_POOL = port_hf('hf-vit-hfnest-mean-pool', {'pool': 'mean'})  # true place: head's input (pooling)
HFNEST_ADAM_B2 = port_hf('hf-vit-hfnest-adam-b2', opt_kw={'b2': 0.99})  # true place: optimizer update
HFNEST_WARMUP = port_hf('hf-vit-hfnest-warmup3', opt_kw={'warmup': 3})  # true place: optimizer learning rate
HFNEST_DECAY_MASK = port_hf(
    'hf-vit-hfnest-decay-all', opt_kw={'mask': flat.new.decay_mask_all}
)  # true place: optimizer weight decay
