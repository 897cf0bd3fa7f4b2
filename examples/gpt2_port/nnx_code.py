"""The same GPT-2 ported to NNX, as the Flax docs teach (not part of the suite).

Modules own their submodules by attribute, under GPT-2's names (``wte``, ``h/0/attn``, ``ln_f``); the
head is ``wte.attend``, tied; the step's dropout key is handed to the model by ``nnx.reseed``; one
``nnx.jit`` step over the model and its ``nnx.Optimizer`` on the global batch, no ``pmean``. The
optimizer is the same optax chain, its weight-decay mask written for NNX's state, whose paths end in
the Variable's ``value``. The sizes are the constructor's arguments, the linen model's fields under the
same names; the defaults are the shrunk model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

VOCAB, N_POSITIONS, N_EMBD, N_LAYER, N_HEAD = 100, 32, 32, 2, 4
DROPOUT, LAYER_NORM_EPSILON = 0.1, 1e-5
LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS = 6e-4, 2, 20
B1, B2, EPS, WEIGHT_DECAY, GRAD_CLIP = 0.9, 0.95, 1e-8, 0.1, 1.0

normal = nnx.initializers.normal


class MLP(nnx.Module):
    def __init__(self, n_embd: int, n_layer: int, *, rngs: nnx.Rngs):
        self.c_fc = nnx.Linear(n_embd, 4 * n_embd, kernel_init=normal(0.02), rngs=rngs)
        self.c_proj = nnx.Linear(4 * n_embd, n_embd, kernel_init=normal(0.02 / np.sqrt(2 * n_layer)), rngs=rngs)
        self.dropout = nnx.Dropout(DROPOUT, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.c_proj(nnx.gelu(self.c_fc(x), approximate=True)))


class Block(nnx.Module):
    def __init__(self, n_embd: int, n_head: int, n_layer: int, *, rngs: nnx.Rngs, epsilon: float):
        self.ln_1 = nnx.LayerNorm(n_embd, epsilon=epsilon, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=n_head, in_features=n_embd, kernel_init=normal(0.02),
                                           dropout_rate=DROPOUT, broadcast_dropout=False, deterministic=False,
                                           decode=False, rngs=rngs)  # fmt: skip
        self.dropout = nnx.Dropout(DROPOUT, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(n_embd, epsilon=epsilon, rngs=rngs)
        self.mlp = MLP(n_embd, n_layer, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.dropout(self.attn(self.ln_1(x), mask=mask))
        return x + self.mlp(self.ln_2(x))


class GPT2(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, vocab_size: int = VOCAB, n_positions: int = N_POSITIONS,
                 n_embd: int = N_EMBD, n_layer: int = N_LAYER, n_head: int = N_HEAD,
                 epsilon: float = LAYER_NORM_EPSILON):  # fmt: skip
        self.wte = nnx.Embed(vocab_size, n_embd, embedding_init=normal(0.02), rngs=rngs)
        self.wpe = nnx.Embed(n_positions, n_embd, embedding_init=normal(0.01), rngs=rngs)
        self.dropout = nnx.Dropout(DROPOUT, rngs=rngs)
        self.h = nnx.List([Block(n_embd, n_head, n_layer, rngs=rngs, epsilon=epsilon) for _ in range(n_layer)])
        self.ln_f = nnx.LayerNorm(n_embd, epsilon=epsilon, rngs=rngs)

    def __call__(self, input_ids):
        x = self.dropout(self.wte(input_ids) + self.wpe(jnp.arange(input_ids.shape[-1])))
        mask = nnx.make_causal_mask(input_ids)
        for block in self.h:
            x = block(x, mask)
        return self.wte.attend(self.ln_f(x))


warmup_fn = optax.linear_schedule(0.0, LEARNING_RATE, WARMUP_STEPS)
decay_fn = optax.linear_schedule(LEARNING_RATE, 0, TOTAL_STEPS - WARMUP_STEPS)
learning_rate_fn = optax.join_schedules([warmup_fn, decay_fn], boundaries=[WARMUP_STEPS])


def decay_mask_fn(params: nnx.State) -> nnx.State:
    """No weight decay on the biases and the LayerNorm scales: the names along a leaf's path, less the
    Variable's own ``value`` that ends it."""

    def decay(path, _):
        names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        return names[-1] != 'bias' and names[-2:] not in {('ln_1', 'scale'), ('ln_2', 'scale'), ('ln_f', 'scale')}

    return jax.tree_util.tree_map_with_path(decay, params)


def create_optimizer(model: GPT2, mask=decay_mask_fn) -> nnx.Optimizer:
    adamw = optax.adamw(learning_rate_fn, b1=B1, b2=B2, eps=EPS, weight_decay=WEIGHT_DECAY, mask=mask)
    return nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(GRAD_CLIP), adamw), wrt=nnx.Param)


@nnx.jit
def train_step(model: GPT2, optimizer: nnx.Optimizer, batch, dropout_rng):
    nnx.reseed(model, dropout=dropout_rng)
    input_ids = batch['input_ids']

    def loss_fn(model):
        logits = model(input_ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], input_ids[:, 1:]).mean()

    lr = learning_rate_fn(optimizer.step[...])
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {'loss': loss, 'learning_rate': lr}
