"""A team's NNX port of HF's Flax ViT for image classification, written from the HF modules' behaviour: patch
embedding by a strided Conv, a CLS token and learned positions, pre-LN encoder blocks, the head on the CLS token.
Attention dropout is drawn as HF draws it (dot_product_attention_weights, broadcast over heads), its key from the
layer's own stream (self.rngs.dropout()); hidden dropout by nnx.Dropout. Trained by nnx.Optimizer in an nnx.jit step
that reseeds the dropout stream from the step's key."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.nn.attention import dot_product_attention_weights

IMAGE_SIZE, PATCH_SIZE, CHANNELS = 16, 4, 3
HIDDEN, LAYERS, HEADS, INTERMEDIATE, NUM_LABELS = 32, 2, 4, 64, 10
HIDDEN_DROPOUT, ATTN_DROPOUT = 0.1, 0.1
LN_EPS = 1e-12
LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS = 1e-3, 2, 20
B1, B2, EPS, WEIGHT_DECAY = 0.9, 0.999, 1e-8, 0.05

init = nnx.initializers.normal(0.02)


def dense(i, o, rngs):
    return nnx.Linear(i, o, kernel_init=init, rngs=rngs)


class SelfAttention(nnx.Module):
    def __init__(self, *, rngs, attn_dropout=ATTN_DROPOUT, out_dropout=HIDDEN_DROPOUT, q_scale=1.0):
        self.head_dim = HIDDEN // HEADS
        self.attn_dropout, self.q_scale, self.rngs = attn_dropout, q_scale, rngs
        self.deterministic = False
        self.query = dense(HIDDEN, HIDDEN, rngs)
        self.key = dense(HIDDEN, HIDDEN, rngs)
        self.value = dense(HIDDEN, HIDDEN, rngs)
        self.out = dense(HIDDEN, HIDDEN, rngs)
        self.out_dropout = nnx.Dropout(out_dropout, rngs=rngs)

    def __call__(self, x):
        B, T, _ = x.shape
        q, k, v = (m(x).reshape(B, T, HEADS, self.head_dim) for m in (self.query, self.key, self.value))
        q = q * self.q_scale
        dropout_rng = None if self.deterministic or self.attn_dropout == 0.0 else self.rngs.dropout()
        w = dot_product_attention_weights(
            q,
            k,
            dropout_rng=dropout_rng,
            dropout_rate=self.attn_dropout,
            broadcast_dropout=True,
            deterministic=self.deterministic,
        )
        out = jnp.einsum('...hqk,...khd->...qhd', w, v).reshape(B, T, HIDDEN)
        return self.out_dropout(self.out(out))


class MLP(nnx.Module):
    def __init__(self, *, rngs, approximate=False):
        self.approximate = approximate
        self.fc1 = dense(HIDDEN, INTERMEDIATE, rngs)
        self.fc2 = dense(INTERMEDIATE, HIDDEN, rngs)
        self.dropout = nnx.Dropout(HIDDEN_DROPOUT, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.fc2(nnx.gelu(self.fc1(x), approximate=self.approximate)))


class Block(nnx.Module):
    def __init__(self, *, rngs, ln_eps=LN_EPS, **kw):
        self.layernorm_before = nnx.LayerNorm(HIDDEN, epsilon=ln_eps, rngs=rngs)
        self.attn = SelfAttention(
            rngs=rngs, **{k: kw[k] for k in ('attn_dropout', 'out_dropout', 'q_scale') if k in kw}
        )
        self.layernorm_after = nnx.LayerNorm(HIDDEN, epsilon=LN_EPS, rngs=rngs)
        self.mlp = MLP(rngs=rngs, **{k: kw[k] for k in ('approximate',) if k in kw})

    def __call__(self, x):
        x = x + self.attn(self.layernorm_before(x))
        return x + self.mlp(self.layernorm_after(x))


class ViT(nnx.Module):
    """`layer0` holds keyword slips for the first block only; `pool` is 'cls' (HF) or 'mean'."""

    def __init__(self, *, rngs, layer0=None, pool='cls'):
        n = (IMAGE_SIZE // PATCH_SIZE) ** 2
        self.pool = pool
        self.patch_embed = nnx.Conv(
            CHANNELS, HIDDEN, (PATCH_SIZE, PATCH_SIZE), strides=PATCH_SIZE, padding='VALID', kernel_init=init, rngs=rngs
        )
        self.cls_token = nnx.Param(jnp.zeros((1, 1, HIDDEN)))
        self.pos_embed = nnx.Param(jnp.zeros((1, n + 1, HIDDEN)))
        self.dropout = nnx.Dropout(HIDDEN_DROPOUT, rngs=rngs)
        self.blocks = nnx.List([Block(rngs=rngs, **((layer0 or {}) if i == 0 else {})) for i in range(LAYERS)])
        self.norm = nnx.LayerNorm(HIDDEN, epsilon=LN_EPS, rngs=rngs)
        self.head = dense(HIDDEN, NUM_LABELS, rngs)

    def __call__(self, images_nhwc):
        x = self.patch_embed(images_nhwc)
        B = x.shape[0]
        x = x.reshape(B, -1, HIDDEN)
        x = jnp.concatenate([jnp.broadcast_to(self.cls_token[...], (B, 1, HIDDEN)), x], axis=1)
        x = self.dropout(x + self.pos_embed[...])
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.head(x[:, 0] if self.pool == 'cls' else x.mean(axis=1))


def make_lr(warmup=WARMUP_STEPS):
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, LEARNING_RATE, warmup),
            optax.linear_schedule(LEARNING_RATE, 0.0, TOTAL_STEPS - warmup),
        ],
        boundaries=[warmup],
    )


def decay_mask(params):
    """No weight decay on biases and LayerNorm scales."""

    def decay(path, _):
        names = tuple(str(getattr(k, 'key', k)) for k in path)
        return names[-1] != 'bias' and not any(n in ('layernorm_before', 'layernorm_after', 'norm') for n in names)

    return jax.tree_util.tree_map_with_path(decay, params)


def decay_mask_all(params):
    return jax.tree_util.tree_map(lambda _: True, params)


def create_optimizer(model, b2=B2, warmup=WARMUP_STEPS, mask=decay_mask):
    tx = optax.adamw(make_lr(warmup), b1=B1, b2=b2, eps=EPS, weight_decay=WEIGHT_DECAY, mask=mask)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch, dropout_rng):
    nnx.reseed(model, dropout=dropout_rng)
    images = jnp.transpose(batch['pixel_values'], (0, 2, 3, 1))  # the loader's NCHW -> NHWC
    labels = batch['labels']

    def loss_fn(model):
        logits = model(images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {'loss': loss}


if __name__ == '__main__':  # runs on its own
    import hf_vit_legacy
    import numpy as np

    model = ViT(rngs=nnx.Rngs(0))
    optimizer = create_optimizer(model)
    data = hf_vit_legacy.make_data(np.random.default_rng(0), 10, 16)
    key = jax.random.PRNGKey(0)
    for i in range(10):
        key, step_key = jax.random.split(key)
        print(i, train_step(model, optimizer, {k: v[i] for k, v in data.items()}, step_key))
