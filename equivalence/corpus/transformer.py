"""A small Transformer encoder: correct, and four porting slips, each one constant off on the NNX
side (the two optimizer slips need the team's own loops: ``transformer_loop``).

The correct port is ill-conditioned on purpose, as translation Transformers are: AdamW with
``b2=0.98, eps=1e-9`` (where a gradient nearly cancels, Adam turns its float32 rounding into a
full step), dropout 0.1 in three places, 20 steps; and, as linen's and NNX's attention have by
default, a bias on the keys, whose true gradient is 0 (softmax ignores a constant added to
every key's score), so Adam's steps on it are rounding noise. Linen names its submodules
itself (``Dense_0``, ``LayerNorm_1``); the NNX port names attributes, paired through ``names=``.

The task: each token's label is the token before it (cyclically), so attention has work to do.
Attention dropout is 0 on both sides (the suite bridges ``Dropout`` layers, not attention's).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from equivalence import ModelPort
from equivalence.corpus.entry import Entry

VOCAB, LENGTH, WIDTH, HEADS, HIDDEN, DROPOUT = 16, 8, 16, 2, 32, 0.1
LABEL_SMOOTHING = 0.1


class LinenEncoder(nn.Module):
    """One pre-LN encoder block and a per-token classifier head, written the linen way."""

    @nn.compact
    def __call__(self, tokens_BxL: jax.Array, train: bool) -> jax.Array:
        pos_LxW = self.param('pos', nn.initializers.normal(0.02), (LENGTH, WIDTH))
        x = nn.Embed(VOCAB, WIDTH)(tokens_BxL) + pos_LxW
        h = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.0, deterministic=True)(nn.LayerNorm()(x))
        x = x + nn.Dropout(DROPOUT, deterministic=not train)(h)
        h = nn.Dropout(DROPOUT, deterministic=not train)(nn.gelu(nn.Dense(HIDDEN)(nn.LayerNorm()(x))))
        x = x + nn.Dropout(DROPOUT, deterministic=not train)(nn.Dense(WIDTH)(h))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class NnxEncoder(nnx.Module):
    """The NNX port. Each keyword is one place a port can slip; the defaults are linen's."""

    def __init__(self, *, rngs: nnx.Rngs, epsilon: float = 1e-6, approximate: bool = True, moved: bool = False):
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (LENGTH, WIDTH)))
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.ln1 = nnx.LayerNorm(WIDTH, epsilon=epsilon, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, dropout_rate=0.0, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(WIDTH, epsilon=epsilon, rngs=rngs)
        self.mlp_in = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
        self.mlp_out = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)
        self.ln_f = nnx.LayerNorm(WIDTH, epsilon=epsilon, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)
        self.drops = nnx.List([nnx.Dropout(DROPOUT, rngs=rngs) for _ in range(3)])
        self.approximate, self.moved = approximate, moved

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        x = self.embed(tokens_BxL) + self.pos[...]
        h = self.attn(self.ln1(x), deterministic=True)
        x = self.drops[0](x + h) if self.moved else x + self.drops[0](h)  # moved: dropout on the sum
        h = self.drops[1](nnx.gelu(self.mlp_in(self.ln2(x)), approximate=self.approximate))
        x = x + self.drops[2](self.mlp_out(h))
        return self.head(self.ln_f(x))


NAMES = {
    'Embed_0': 'embed',
    'LayerNorm_0': 'ln1',
    'MultiHeadDotProductAttention_0': 'attn',
    'LayerNorm_1': 'ln2',
    'Dense_0': 'mlp_in',
    'Dense_1': 'mlp_out',
    'LayerNorm_2': 'ln_f',
    'Dense_2': 'head',
}


def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict[str, np.ndarray]:
    tokens = rng.integers(0, VOCAB, size=(n_steps, batch, LENGTH), dtype=np.int32)
    return {'x': tokens, 'y': np.roll(tokens, 1, axis=-1)}


def token_losses(logits_BxLxV: jax.Array, labels_BxL: jax.Array, smoothing: float) -> jax.Array:
    targets = optax.smooth_labels(jax.nn.one_hot(labels_BxL, VOCAB), smoothing)
    return jnp.mean(optax.softmax_cross_entropy(logits_BxLxV, targets), axis=-1)


def linen_loss(model, params, model_state, batch, noise):
    return token_losses(model.apply({'params': params}, batch['x'], train=True), batch['y'], LABEL_SMOOTHING)


def nnx_loss(smoothing: float = LABEL_SMOOTHING):
    return lambda model, batch, noise: token_losses(model(batch['x']), batch['y'], smoothing)


def make_tx(eps: float = 1e-9, weight_decay: float = 1e-2, lr: float = 1e-3) -> optax.GradientTransformation:
    """A translation Transformer's optimizer: AdamW, b2 0.98, eps 1e-9."""
    return optax.adamw(lr, b1=0.9, b2=0.98, eps=eps, weight_decay=weight_decay)


MODEL = ModelPort(
    name='transformer',
    legacy_model=LinenEncoder,
    nnx_model=lambda rngs: NnxEncoder(rngs=rngs),
    legacy_loss=linen_loss,
    nnx_loss=nnx_loss(),
    make_data=make_data,
    make_tx=lambda lr_scale=1.0: make_tx(lr=1e-3 * lr_scale),
    init_args=lambda batch: (batch['x'], False),
    names=NAMES,
    default_batch=32,
    summary='encoder block, AdamW eps 1e-9, dropout 0.1',
)


def _slip(name: str, **changes) -> ModelPort:
    return dataclasses.replace(MODEL, name=name, **changes)


LN_EPS_SLIP = _slip('tf-layernorm-eps', nnx_model=lambda rngs: NnxEncoder(rngs=rngs, epsilon=1e-5))
GELU_SLIP = _slip('tf-gelu-exact', nnx_model=lambda rngs: NnxEncoder(rngs=rngs, approximate=False))
DROPOUT_SLIP = _slip('tf-dropout-moved', nnx_model=lambda rngs: NnxEncoder(rngs=rngs, moved=True))
SMOOTHING_SLIP = _slip('tf-label-smoothing', nnx_loss=nnx_loss(smoothing=0.0))

ENTRIES = [
    Entry(
        'transformer',
        'correct',
        MODEL,
        'AdamW eps 1e-9, 3 dropouts, attention key bias (softmax ignores it: gradient 0)',
        quick=True,
    ),
    Entry('tf-layernorm-eps', 'slip', LN_EPS_SLIP, 'NNX LayerNorm epsilon 1e-5, linen 1e-6', kind='math', quick=True),
    Entry('tf-gelu-exact', 'slip', GELU_SLIP, 'NNX gelu(approximate=False), linen approximate', kind='math'),
    Entry(
        'tf-dropout-moved',
        'slip',
        DROPOUT_SLIP,
        'NNX drops the residual sum, linen the attention branch',
        kind='randomness',
    ),
    Entry('tf-label-smoothing', 'slip', SMOOTHING_SLIP, 'NNX loss without label smoothing 0.1', kind='math'),
]
