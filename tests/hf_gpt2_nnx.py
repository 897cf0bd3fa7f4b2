"""A typical NNX port of HF's Flax GPT-2: Conv1D kernels kept in HF's [out, in] layout, positions arange(T), the
attention's dropout drawn as HF draws it (by dot_product_attention_weights, its key from the layer's own stream)."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.nn.attention import dot_product_attention_weights

VOCAB, N_POSITIONS, N_EMBD, N_LAYER, N_HEAD = 100, 32, 32, 2, 4
EMBD_PDROP, RESID_PDROP, ATTN_PDROP = 0.1, 0.1, 0.1
LAYER_NORM_EPSILON = 1e-5
LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS = 6e-4, 2, 20
B1, B2, EPS, WEIGHT_DECAY, GRAD_CLIP = 0.9, 0.95, 1e-8, 0.1, 1.0

normal = nnx.initializers.normal


class Conv1D(nnx.Module):
    def __init__(self, in_features, features, *, rngs):
        self.kernel = nnx.Param(normal(0.02)(rngs.params(), (features, in_features)))
        self.bias = nnx.Param(jnp.zeros((features,)))

    def __call__(self, x):
        return jnp.dot(x, self.kernel[...].T) + self.bias[...]


class Attention(nnx.Module):
    def __init__(self, n_embd, n_head, *, rngs, q_scale=1.0, resid_pdrop=RESID_PDROP, causal=True):
        self.n_embd, self.n_head, self.head_dim = n_embd, n_head, n_embd // n_head
        self.q_scale, self.causal, self.rngs = q_scale, causal, rngs
        self.c_attn = Conv1D(n_embd, 3 * n_embd, rngs=rngs)
        self.c_proj = Conv1D(n_embd, n_embd, rngs=rngs)
        self.resid_dropout = nnx.Dropout(resid_pdrop, rngs=rngs)

    def __call__(self, x):
        B, T, _ = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        q, k, v = (a.reshape(B, T, self.n_head, self.head_dim) for a in (q, k, v))
        q = q * self.q_scale
        mask = jnp.tril(jnp.ones((T, T), bool)) if self.causal else jnp.ones((T, T), bool)
        bias = jnp.where(mask, 0.0, -1e4)[None, None]
        w = dot_product_attention_weights(
            q, k, bias=bias, dropout_rng=self.rngs.dropout(), dropout_rate=ATTN_PDROP, deterministic=False
        )
        out = jnp.einsum('...hqk,...khd->...qhd', w, v).reshape(B, T, self.n_embd)
        return self.resid_dropout(self.c_proj(out))


class MLP(nnx.Module):
    def __init__(self, n_embd, *, rngs, approximate=True):
        self.approximate = approximate
        self.c_fc = Conv1D(n_embd, 4 * n_embd, rngs=rngs)
        self.c_proj = Conv1D(4 * n_embd, n_embd, rngs=rngs)
        self.dropout = nnx.Dropout(RESID_PDROP, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.c_proj(nnx.gelu(self.c_fc(x), approximate=self.approximate)))


class Block(nnx.Module):
    def __init__(self, n_embd, n_head, *, rngs, epsilon, **kw):
        self.ln_1 = nnx.LayerNorm(n_embd, epsilon=epsilon, rngs=rngs)
        self.attn = Attention(
            n_embd, n_head, rngs=rngs, **{k: kw[k] for k in ('q_scale', 'resid_pdrop', 'causal') if k in kw}
        )
        self.ln_2 = nnx.LayerNorm(n_embd, epsilon=epsilon, rngs=rngs)
        self.mlp = MLP(n_embd, rngs=rngs, **{k: kw[k] for k in ('approximate',) if k in kw})

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nnx.Module):
    def __init__(self, *, rngs, epsilon=LAYER_NORM_EPSILON, **kw):
        self.wte = nnx.Embed(VOCAB, N_EMBD, embedding_init=normal(0.02), rngs=rngs)
        self.wpe = nnx.Embed(N_POSITIONS, N_EMBD, embedding_init=normal(0.02), rngs=rngs)
        self.dropout = nnx.Dropout(EMBD_PDROP, rngs=rngs)
        self.h = nnx.List([Block(N_EMBD, N_HEAD, rngs=rngs, epsilon=epsilon, **kw) for _ in range(N_LAYER)])
        self.ln_f = nnx.LayerNorm(N_EMBD, epsilon=epsilon, rngs=rngs)

    def __call__(self, input_ids):
        x = self.dropout(self.wte(input_ids) + self.wpe(jnp.arange(input_ids.shape[-1])))
        for block in self.h:
            x = block(x)
        return self.wte.attend(self.ln_f(x))


def make_lr(warmup=WARMUP_STEPS):
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, LEARNING_RATE, warmup),
            optax.linear_schedule(LEARNING_RATE, 0, TOTAL_STEPS - warmup),
        ],
        boundaries=[warmup],
    )


def decay_mask_fn(params):
    def decay(path, _):
        names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        return names[-1] != 'bias' and names[-2:] not in {('ln_1', 'scale'), ('ln_2', 'scale'), ('ln_f', 'scale')}

    return jax.tree_util.tree_map_with_path(decay, params)


def create_optimizer(model, b2=B2, warmup=WARMUP_STEPS):
    adamw = optax.adamw(make_lr(warmup), b1=B1, b2=b2, eps=EPS, weight_decay=WEIGHT_DECAY, mask=decay_mask_fn)
    return nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(GRAD_CLIP), adamw), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch, dropout_rng):
    nnx.reseed(model, dropout=dropout_rng)
    input_ids = batch['input_ids']

    def loss_fn(model):
        logits = model(input_ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], input_ids[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {'loss': loss}


class GPT2Body(GPT2):
    """The same GPT-2 without its head: HF's FlaxGPT2Module's role."""

    def __call__(self, input_ids):
        x = self.dropout(self.wte(input_ids) + self.wpe(jnp.arange(input_ids.shape[-1])))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHead(nnx.Module):
    """A port that keeps HF's nesting: `transformer` holds the body, the tied head outside it."""

    def __init__(self, *, rngs, **kw):
        self.transformer = GPT2Body(rngs=rngs, **kw)

    def __call__(self, input_ids):
        return self.transformer.wte.attend(self.transformer(input_ids))
