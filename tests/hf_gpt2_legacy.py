"""Legacy side: Hugging Face's FlaxGPT2LMHeadModule (hf_gpt2_modeling.py) trained by a pmap-era step in the style of
run_clm_flax (TrainState, grads pmean'd over 'batch', AdamW with warmup/decay and a decay mask).
Dropout as GPT-2's config has it, 0.1 everywhere: HF's attention draws its own mask (self.make_rng and its own
import of dot_product_attention_weights), which the suite bridges as it does Flax's attention layers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from flax.training import train_state
from hf_gpt2_modeling import FlaxGPT2LMHeadModule, GPT2Config

CONFIG = GPT2Config(
    vocab_size=100,
    n_positions=32,
    n_embd=32,
    n_layer=2,
    n_head=4,
    embd_pdrop=0.1,
    resid_pdrop=0.1,
    attn_pdrop=0.1,
    layer_norm_epsilon=1e-5,
)
SEQ_LEN = 16
LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS = 6e-4, 2, 20
B1, B2, EPS, WEIGHT_DECAY, GRAD_CLIP = 0.9, 0.95, 1e-8, 0.1, 1.0


def model():
    return FlaxGPT2LMHeadModule(CONFIG)


def init_args(batch):
    """HF's init_weights: input_ids, attention_mask of ones, position_ids broadcast [B, T]."""
    input_ids = jnp.asarray(batch['input_ids'], 'i4')
    position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1])[None, :], input_ids.shape)
    return (input_ids, jnp.ones_like(input_ids), position_ids)


def hf_call(params, input_ids, dropout_rng=None, train=False):
    """FlaxGPT2PreTrainedModel.__call__ (no cache): position_ids [B, T], attention_mask ones."""
    batch_size, sequence_length = input_ids.shape
    position_ids = jnp.broadcast_to(jnp.arange(sequence_length)[None, :], (batch_size, sequence_length))
    attention_mask = jnp.ones((batch_size, sequence_length))
    rngs = {}
    if dropout_rng is not None:
        rngs['dropout'] = dropout_rng
    return model().apply(
        {'params': params},
        jnp.array(input_ids, dtype='i4'),
        jnp.array(attention_mask, dtype='i4'),
        jnp.array(position_ids, dtype='i4'),
        not train,
        False,
        False,
        False,
        False,
        rngs=rngs,
    )


def create_learning_rate_fn(num_train_steps, num_warmup_steps, learning_rate):
    warmup_fn = optax.linear_schedule(init_value=0.0, end_value=learning_rate, transition_steps=num_warmup_steps)
    decay_fn = optax.linear_schedule(
        init_value=learning_rate, end_value=0, transition_steps=num_train_steps - num_warmup_steps
    )
    return optax.join_schedules(schedules=[warmup_fn, decay_fn], boundaries=[num_warmup_steps])


learning_rate_fn = create_learning_rate_fn(TOTAL_STEPS, WARMUP_STEPS, LEARNING_RATE)


def decay_mask_fn(params):
    """run_clm_flax's decay_mask_fn."""
    flat_params = traverse_util.flatten_dict(params)
    layer_norm_candidates = ['layernorm', 'layer_norm', 'ln']
    layer_norm_named_params = {
        layer[-2:]
        for layer_norm_name in layer_norm_candidates
        for layer in flat_params.keys()
        if layer_norm_name in ''.join(layer).lower()
    }
    flat_mask = {path: (path[-1] != 'bias' and path[-2:] not in layer_norm_named_params) for path in flat_params}
    return traverse_util.unflatten_dict(flat_mask)


def make_tx():
    adamw = optax.adamw(
        learning_rate=learning_rate_fn, b1=B1, b2=B2, eps=EPS, weight_decay=WEIGHT_DECAY, mask=decay_mask_fn
    )
    return optax.chain(optax.clip_by_global_norm(GRAD_CLIP), adamw)


def create_train_state(params):
    return train_state.TrainState.create(apply_fn=model().apply, params=params, tx=make_tx())


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits[..., :-1, :], labels[..., 1:]).mean()


def train_step(state, batch, dropout_rng):
    def compute_loss(params):
        logits = hf_call(params, batch['input_ids'], dropout_rng=dropout_rng, train=True)[0]
        return loss_fn(logits, batch['input_ids'])

    loss, grad = jax.value_and_grad(compute_loss)(state.params)
    grad = jax.lax.pmean(grad, 'batch')
    new_state = state.apply_gradients(grads=grad)
    metrics = {'loss': loss, 'learning_rate': learning_rate_fn(state.step)}
    return new_state, jax.lax.pmean(metrics, axis_name='batch')


def make_data(rng, n_steps, batch, vocab_size=CONFIG.vocab_size, seq_len=SEQ_LEN):
    start = rng.integers(0, vocab_size, size=(n_steps, batch, 1))
    tokens = (start + np.arange(seq_len)) % vocab_size
    noise = rng.integers(0, vocab_size, size=tokens.shape)
    return {'input_ids': np.where(rng.random(tokens.shape) < 0.1, noise, tokens).astype(np.int32)}
