"""The same NNX port, its encoder block nested as HF nests it (attention/attention, attention/output/dense,
intermediate/dense, output/dense): the one change tried to make the suite accept the correct port."""

import hf_vit_nnx as flat
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.attention import dot_product_attention_weights
from hf_vit_nnx import ATTN_DROPOUT, HEADS, HIDDEN, HIDDEN_DROPOUT, INTERMEDIATE, LAYERS, LN_EPS, dense


class SelfAttention(nnx.Module):
    def __init__(self, *, rngs, attn_dropout=ATTN_DROPOUT, q_scale=1.0):
        self.head_dim, self.attn_dropout, self.q_scale, self.rngs = HIDDEN // HEADS, attn_dropout, q_scale, rngs
        self.deterministic = False
        self.query, self.key, self.value = (dense(HIDDEN, HIDDEN, rngs) for _ in range(3))

    def __call__(self, x):
        B, T, _ = x.shape
        q, k, v = (m(x).reshape(B, T, HEADS, self.head_dim) for m in (self.query, self.key, self.value))
        dropout_rng = None if self.deterministic or self.attn_dropout == 0.0 else self.rngs.dropout()
        w = dot_product_attention_weights(
            q * self.q_scale,
            k,
            dropout_rng=dropout_rng,
            dropout_rate=self.attn_dropout,
            broadcast_dropout=True,
            deterministic=self.deterministic,
        )
        return jnp.einsum('...hqk,...khd->...qhd', w, v).reshape(B, T, HIDDEN)


class DenseDropout(nnx.Module):
    def __init__(self, i, o, rate, *, rngs):
        self.dense = dense(i, o, rngs)
        self.dropout = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.dense(x))


class Attention(nnx.Module):
    def __init__(self, *, rngs, out_dropout=HIDDEN_DROPOUT, **kw):
        self.attention = SelfAttention(rngs=rngs, **kw)
        self.output = DenseDropout(HIDDEN, HIDDEN, out_dropout, rngs=rngs)

    def __call__(self, x):
        return self.output(self.attention(x))


class Intermediate(nnx.Module):
    def __init__(self, *, rngs, approximate=False):
        self.approximate = approximate
        self.dense = dense(HIDDEN, INTERMEDIATE, rngs)

    def __call__(self, x):
        return nnx.gelu(self.dense(x), approximate=self.approximate)


class Block(nnx.Module):
    def __init__(self, *, rngs, ln_eps=LN_EPS, approximate=False, **kw):
        self.layernorm_before = nnx.LayerNorm(HIDDEN, epsilon=ln_eps, rngs=rngs)
        self.attention = Attention(rngs=rngs, **kw)
        self.layernorm_after = nnx.LayerNorm(HIDDEN, epsilon=LN_EPS, rngs=rngs)
        self.intermediate = Intermediate(rngs=rngs, approximate=approximate)
        self.output = DenseDropout(INTERMEDIATE, HIDDEN, HIDDEN_DROPOUT, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.layernorm_before(x))
        return x + self.output(self.intermediate(self.layernorm_after(x)))


class ViT(flat.ViT):
    def __init__(self, *, rngs, layer0=None, pool='cls'):
        super().__init__(rngs=rngs, pool=pool)
        self.blocks = nnx.List([Block(rngs=rngs, **((layer0 or {}) if i == 0 else {})) for i in range(LAYERS)])


class Output(DenseDropout):
    """HF's FlaxViTOutput: the second residual inside the module."""

    def __call__(self, x, attention_output):
        return self.dropout(self.dense(x)) + attention_output


class BlockHF(Block):
    def __init__(self, *, rngs, **kw):
        super().__init__(rngs=rngs, **kw)
        self.output = Output(INTERMEDIATE, HIDDEN, HIDDEN_DROPOUT, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.layernorm_before(x))
        return self.output(self.intermediate(self.layernorm_after(x)), x)


class ViTHF(flat.ViT):
    """Nested as HF nests it, the second residual inside `output` as HF has it."""

    def __init__(self, *, rngs, layer0=None, pool='cls'):
        super().__init__(rngs=rngs, pool=pool)
        self.blocks = nnx.List([BlockHF(rngs=rngs, **((layer0 or {}) if i == 0 else {})) for i in range(LAYERS)])
