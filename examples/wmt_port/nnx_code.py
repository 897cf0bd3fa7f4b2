"""The same Transformer ported to NNX, as the Flax docs teach (not part of the suite).

Attributes named for what they are; dropout keys from the model's ``nnx.Rngs``, reseeded each
step with ``fold_in(dropout_rng, step)`` as the pmap step folds them; one ``nnx.jit`` step over
the model and its ``nnx.Optimizer``; no ``psum``: the metrics are sums over the global batch.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

VOCAB, EMB, HEADS, MLP, DROPOUT = 16, 16, 2, 32, 0.1
LEARNING_RATE, WARMUP_STEPS, LABEL_SMOOTHING = 0.05, 4, 0.1


class DecoderBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, broadcast_dropout: bool = False):
        self.ln1, self.ln2 = nnx.LayerNorm(EMB, rngs=rngs), nnx.LayerNorm(EMB, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=EMB, qkv_features=EMB, use_bias=False,
                                           broadcast_dropout=broadcast_dropout, dropout_rate=DROPOUT, decode=False,
                                           deterministic=False, rngs=rngs)  # fmt: skip
        self.fc1, self.fc2 = nnx.Linear(EMB, MLP, rngs=rngs), nnx.Linear(MLP, EMB, rngs=rngs)
        self.drop = nnx.Dropout(DROPOUT, rngs=rngs)

    def __call__(self, y, mask):
        y = y + self.drop(self.attn(self.ln1(y), mask=mask))
        return y + self.drop(self.fc2(self.drop(nnx.relu(self.fc1(self.ln2(y))))))


class Decoder(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, broadcast_dropout: bool = False):
        self.embed = nnx.Embed(VOCAB, EMB, rngs=rngs)
        self.drop = nnx.Dropout(DROPOUT, rngs=rngs)
        self.block = DecoderBlock(rngs=rngs, broadcast_dropout=broadcast_dropout)
        self.ln_out, self.head = nnx.LayerNorm(EMB, rngs=rngs), nnx.Linear(EMB, VOCAB, rngs=rngs)

    def __call__(self, targets):
        mask = nnx.combine_masks(nnx.make_attention_mask(targets > 0, targets > 0), nnx.make_causal_mask(targets))
        y = self.drop(self.embed(jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]))
        return self.head(self.ln_out(self.block(y, mask)))


def learning_rate_fn(step):
    return LEARNING_RATE * jnp.minimum(1.0, step / WARMUP_STEPS) / jnp.sqrt(jnp.maximum(step, WARMUP_STEPS))


def create_optimizer(model: Decoder) -> nnx.Optimizer:
    tx = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def weighted_cross_entropy(logits, targets, weights, label_smoothing: float):
    smoothed = optax.smooth_labels(jax.nn.one_hot(targets, VOCAB), label_smoothing * VOCAB / (VOCAB - 1))
    confidence, low = 1.0 - label_smoothing, label_smoothing / (VOCAB - 1)
    entropy = -(confidence * jnp.log(confidence) + (VOCAB - 1) * low * jnp.log(low + 1e-20))
    loss = optax.softmax_cross_entropy(logits, smoothed) - entropy
    return jnp.sum(loss * weights), jnp.sum(weights)


@nnx.jit
def train_step(model: Decoder, optimizer: nnx.Optimizer, batch, dropout_rng):
    targets = batch['targets']
    weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
    nnx.reseed(model, dropout=jax.random.fold_in(dropout_rng, optimizer.step[...]))

    def loss_fn(model):
        logits = model(targets)
        loss, weight_sum = weighted_cross_entropy(logits, targets, weights, LABEL_SMOOTHING)
        return loss / weight_sum, logits

    lr = learning_rate_fn(optimizer.step[...])
    (_, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    loss, weight_sum = weighted_cross_entropy(logits, targets, weights, 0.0)
    accuracy = jnp.sum((jnp.argmax(logits, -1) == targets) * weights)
    return {'loss': loss, 'accuracy': accuracy, 'denominator': weight_sum, 'learning_rate': lr}
