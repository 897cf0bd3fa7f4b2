"""A team's pmap-era GPT-2 training code, written as Hugging Face's ``run_clm_flax.py`` and the GPT-2
reproductions of its time were (linen era): a decoder-only Transformer with learned positions, pre-LN
blocks (LayerNorm epsilon 1e-5, GPT-2's ``layer_norm_epsilon``), GELU in its tanh approximation,
dropout 0.1 on the embeddings, the attention weights and both residual branches, the head tied to
the token embedding, the positions as Hugging Face's ``FlaxGPT2LMHeadModel`` makes them (``[B, T]``, every row
``arange(T)``); a flax ``TrainState``, ``jax.pmap(train_step, axis_name='batch')`` with the
gradients ``pmean``'d by hand; AdamW (b2 0.95, weight decay 0.1) masked off the biases and the
LayerNorm scales as ``run_clm_flax``'s ``decay_mask_fn``, after gradient clipping at global norm 1,
on a linear warmup and linear decay. The step's dropout key is handed in by the host loop, a fresh
one every step (``run_clm_flax`` keeps it in its ``TrainState`` and splits it in the step, one key
per device: a global-batch port cannot draw those masks, docs/randomness.md).

Its sizes are the model's fields, as GPT-2's config names them (``vocab_size``, ``n_positions``,
``n_embd``, ``n_layer``, ``n_head``): the defaults are shrunk to a 100-token vocabulary, 2 layers of
width 32 and sequences of 16, so that it trains on a CPU in seconds; ``my_port.py`` sets GPT-2
small. The schedule is shrunk at every size (2 warmup steps of 20), so that a check's few steps see
it warm up. Not part of the suite.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from flax.training import train_state

VOCAB, N_POSITIONS, N_EMBD, N_LAYER, N_HEAD, SEQ_LEN = 100, 32, 32, 2, 4, 16
DROPOUT, LAYER_NORM_EPSILON = 0.1, 1e-5
LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS = 6e-4, 2, 20
B1, B2, EPS, WEIGHT_DECAY, GRAD_CLIP = 0.9, 0.95, 1e-8, 0.1, 1.0

normal = nn.initializers.normal


class MLP(nn.Module):
    n_embd: int
    n_layer: int

    @nn.compact
    def __call__(self, x, deterministic: bool):
        h = nn.Dense(4 * self.n_embd, kernel_init=normal(0.02), name='c_fc')(x)
        h = nn.gelu(h, approximate=True)  # GPT-2's gelu_new
        proj_init = normal(0.02 / np.sqrt(2 * self.n_layer))  # GPT-2's scaled init of residual projections
        h = nn.Dense(self.n_embd, kernel_init=proj_init, name='c_proj')(h)
        return nn.Dropout(rate=DROPOUT)(h, deterministic=deterministic)


class Block(nn.Module):
    n_embd: int
    n_head: int
    n_layer: int

    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        h = nn.LayerNorm(epsilon=LAYER_NORM_EPSILON, name='ln_1')(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.n_head, kernel_init=normal(0.02), dropout_rate=DROPOUT,
                                            broadcast_dropout=False, deterministic=deterministic,
                                            name='attn')(h, mask=mask)  # fmt: skip
        x = x + nn.Dropout(rate=DROPOUT)(h, deterministic=deterministic)
        h = nn.LayerNorm(epsilon=LAYER_NORM_EPSILON, name='ln_2')(x)
        return x + MLP(self.n_embd, self.n_layer, name='mlp')(h, deterministic)


class GPT2(nn.Module):
    vocab_size: int = VOCAB
    n_positions: int = N_POSITIONS
    n_embd: int = N_EMBD
    n_layer: int = N_LAYER
    n_head: int = N_HEAD

    @nn.compact
    def __call__(self, input_ids, train: bool = True):
        wte = nn.Embed(self.vocab_size, self.n_embd, embedding_init=normal(0.02), name='wte')
        wpe = nn.Embed(self.n_positions, self.n_embd, embedding_init=normal(0.01), name='wpe')
        position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1])[None, :], input_ids.shape)  # as HF's
        x = wte(input_ids) + wpe(position_ids)
        x = nn.Dropout(rate=DROPOUT)(x, deterministic=not train)
        mask = nn.make_causal_mask(input_ids)
        for i in range(self.n_layer):
            x = Block(self.n_embd, self.n_head, self.n_layer, name=f'h_{i}')(x, mask, not train)
        x = nn.LayerNorm(epsilon=LAYER_NORM_EPSILON, name='ln_f')(x)
        return wte.attend(x)  # the head is the token embedding, tied


def create_learning_rate_fn(num_train_steps: int, num_warmup_steps: int, learning_rate: float):
    """run_clm_flax's: linear warmup from 0, then linear decay to 0."""
    warmup_fn = optax.linear_schedule(init_value=0.0, end_value=learning_rate, transition_steps=num_warmup_steps)
    decay_fn = optax.linear_schedule(init_value=learning_rate, end_value=0,
                                     transition_steps=num_train_steps - num_warmup_steps)  # fmt: skip
    return optax.join_schedules(schedules=[warmup_fn, decay_fn], boundaries=[num_warmup_steps])


learning_rate_fn = create_learning_rate_fn(TOTAL_STEPS, WARMUP_STEPS, LEARNING_RATE)


def decay_mask_fn(params):
    """No weight decay on the biases and the LayerNorm scales (run_clm_flax's, for GPT-2's names)."""
    flat_params = traverse_util.flatten_dict(params)
    layer_norms = [('ln_1', 'scale'), ('ln_2', 'scale'), ('ln_f', 'scale')]
    flat_mask = {path: (path[-1] != 'bias' and path[-2:] not in layer_norms) for path in flat_params}
    return traverse_util.unflatten_dict(flat_mask)


def make_tx() -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate=learning_rate_fn, b1=B1, b2=B2, eps=EPS, weight_decay=WEIGHT_DECAY,
                        mask=decay_mask_fn)  # fmt: skip
    return optax.chain(optax.clip_by_global_norm(GRAD_CLIP), adamw)


def create_train_state(params, model: nn.Module | None = None) -> train_state.TrainState:
    return train_state.TrainState.create(apply_fn=(model or GPT2()).apply, params=params, tx=make_tx())


def loss_fn(logits, labels):
    """Next-token cross-entropy: position t predicts token t + 1."""
    return optax.softmax_cross_entropy_with_integer_labels(logits[..., :-1, :], labels[..., 1:]).mean()


def train_step(state, batch, dropout_rng):
    """One step on one device; the host hands every step a fresh ``dropout_rng``."""

    def compute_loss(params):
        logits = state.apply_fn({'params': params}, batch['input_ids'], train=True, rngs={'dropout': dropout_rng})
        return loss_fn(logits, batch['input_ids'])

    loss, grad = jax.value_and_grad(compute_loss)(state.params)
    grad = jax.lax.pmean(grad, 'batch')
    new_state = state.apply_gradients(grads=grad)
    metrics = {'loss': loss, 'learning_rate': learning_rate_fn(state.step)}
    return new_state, jax.lax.pmean(metrics, axis_name='batch')


def make_data(rng: np.random.Generator, n_steps: int, batch: int, vocab_size: int = VOCAB,
              seq_len: int = SEQ_LEN) -> dict:  # fmt: skip
    """``{'input_ids': [n_steps, batch, seq_len]}``: packed rows of a noisy counting language."""
    start = rng.integers(0, vocab_size, size=(n_steps, batch, 1))
    tokens = (start + np.arange(seq_len)) % vocab_size
    noise = rng.integers(0, vocab_size, size=tokens.shape)
    return {'input_ids': np.where(rng.random(tokens.shape) < 0.1, noise, tokens).astype(np.int32)}


p_train_step = jax.pmap(train_step, 'batch', donate_argnums=(0,))
